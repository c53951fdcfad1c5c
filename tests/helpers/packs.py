"""Packed rows of documents for the layout tests, generated here (independent of hybridsp)."""

from __future__ import annotations

import math
import random


def lognormal_pack(seq_len: int, seed: int) -> tuple[int, ...]:
    """Lengths exp(N(6.4, 1.2)) clipped to [16, 8000], the last one truncated at S."""
    rng = random.Random(1000 + seed)
    bounds = [0]
    while bounds[-1] < seq_len:
        bounds.append(min(seq_len, bounds[-1] + min(8000, max(16, round(math.exp(rng.gauss(6.4, 1.2)))))))
    return tuple(bounds)
