"""The device mesh and where its ranks run.

``hybrid_mesh`` (``MeshShape``, ``HybridMesh``, ``init_mesh``), ``auto_degrees`` (the ``"auto"`` rule),
``timeouts``, ``launcher`` (what the launcher says), ``gloo_interface``, ``placement`` (hosts and groups),
``check_command`` (``python -m hybridsp check-mesh``), ``process_group`` (the default group for scripts without DeepSpeed).
"""
