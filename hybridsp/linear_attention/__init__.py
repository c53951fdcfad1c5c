"""Linear-attention and state-space layers (Gated DeltaNet, Mamba-2) over the U x R mesh.

The Ulysses axis splits whole head groups (``_heads``); the ring axis passes the recurrent
state exactly in natural token order (``_segments``, ``_passing``) with the convolution's halos
(``_conv``); ``_delta_rule`` and ``_mamba2`` are the two recurrences; ``_decode`` the generation
states. Users reach it through the transformers switch
(:func:`hybridsp.integrations.transformers.apply`); the public names here are the cost model
(:func:`linear_layer_bytes`, :func:`linear_layer_memory`, :class:`LinearLayerSpec`).
"""

from hybridsp.linear_attention._volume import LinearLayerSpec, linear_layer_bytes, linear_layer_memory

__all__ = ["LinearLayerSpec", "linear_layer_bytes", "linear_layer_memory"]
