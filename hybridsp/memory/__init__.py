"""Memory helpers outside attention: ``tiled_mlp``, ``lean_norm`` (RMSNorm keeping no normalized copy),
``offload`` (activation offload),
``zero_gather`` / ``zero_grad`` (ZeRO-3 partitioned parameters gathered and given gradients).
"""
