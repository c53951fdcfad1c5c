"""DeepSpeed ZeRO (stages 0-3) composed with hybrid sequence parallelism: the public face.

    import hybridsp
    from hybridsp.integrations import deepspeed as hds

    engine, optimizer, mesh, undo = hds.initialize(model, "ds_configs/cp8.json", optimizer=opt)
    for full_batch in loader:                          # the same full batch on every context rank
        local = hybridsp.shard_batch(full_batch, mesh)
        logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"],
                        use_cache=False).logits
        loss = hybridsp.sharded_cross_entropy(logits, local["shift_labels"], mesh)
        engine.backward(loss)
        engine.step()

Modules: ``config`` (the ``"hybridsp"`` section, its checks, DeepSpeed's cleaned config), ``engine``
(the mpu, the mesh, the engine's ``initialize``, the gradient scale; its notes), ``entry`` (the
public ``initialize``: the engine plus the attention switch the model needs), ``tensor`` (the tensor axis),
``checkpoint`` / ``checkpoint_files`` (mesh-aware checkpoints, resume on another mesh).
"""

from __future__ import annotations

from hybridsp.integrations import lazy_exports

_EXPORTS = {
    "OWNED_KEYS": "hybridsp.integrations.deepspeed._config",
    "PRECISIONS": "hybridsp.integrations.deepspeed._config",
    "SECTION": "hybridsp.integrations.deepspeed._config",
    "SECTION_KEYS": "hybridsp.integrations.deepspeed._config",
    "HybridConfig": "hybridsp.integrations.deepspeed._config",
    "auto_precision": "hybridsp.integrations.deepspeed._config",
    "deepspeed_config": "hybridsp.integrations.deepspeed._config",
    "load_config": "hybridsp.integrations.deepspeed._config",
    "resolve_precision": "hybridsp.integrations.deepspeed._config",
    "HybridEngine": "hybridsp.integrations.deepspeed._engine",
    "HybridMPU": "hybridsp.integrations.deepspeed._engine",
    "build_mesh": "hybridsp.integrations.deepspeed._engine",
    "init_distributed": "hybridsp.integrations.deepspeed._engine",
    "initialize": "hybridsp.integrations.deepspeed._entry",
    "scale_gradients": "hybridsp.integrations.deepspeed._engine",
    "without_cpu_shm_comm_build": "hybridsp.integrations.deepspeed._engine",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
