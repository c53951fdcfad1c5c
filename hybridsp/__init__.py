"""hybridsp: hybrid Ulysses x ring sequence-parallel attention for long-context training."""

from hybridsp.comm import CommCounter
from hybridsp.merge import merge_blocks
from hybridsp.ring import ring_attention

__all__ = ["CommCounter", "merge_blocks", "ring_attention"]
