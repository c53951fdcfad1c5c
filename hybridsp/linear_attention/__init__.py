"""Linear-attention and state-space layers (Gated DeltaNet, Mamba-2) over the U x R mesh.

The Ulysses axis splits whole head groups (:mod:`.heads`); the ring axis passes the recurrent
state exactly in natural token order (:mod:`.plan`, :mod:`.passing`) with the convolution's
halos (:mod:`.conv`); :mod:`.delta_rule` and :mod:`.mamba2` are the two recurrences. The
transformers binding is :mod:`hybridsp.integrations.transformers._linear_layers`.
"""
