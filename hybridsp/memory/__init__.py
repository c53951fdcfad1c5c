"""Memory helpers outside attention: ``tiled_mlp``, ``offload`` (activation offload),
``zero_gather`` / ``zero_grad`` (ZeRO-3 partitioned parameters gathered and given gradients).
"""
