"""Packed rows of documents (generated here, independent of hybridsp).

:func:`lognormal_pack` is the pack of packed.balance and packed.balance_windows (and the packs
docs/packed-documents.md quotes); :func:`packed_lm_batch` is e2e.compile's batch (copied from
tests/helpers/packs.py: benchmarks import nothing from tests).
"""

from __future__ import annotations

import math
import random

import torch


def lognormal_pack(seq_len: int, seed: int, mu: float = 6.4, sigma: float = 1.2) -> tuple[int, ...]:
    """Boundaries of documents with lengths exp(N(mu, sigma)) clipped to [16, 8000] (median ~600;
    the last one truncated to end at S)."""
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < seq_len:
        length = min(8000, max(16, round(math.exp(rng.gauss(mu, sigma)))))
        bounds.append(min(seq_len, bounds[-1] + length))
    return tuple(bounds)


def packed_lm_batch(step: int, seq: int, *, rows: int = 2, vocab: int = 128, low: int = 3) -> dict:
    """input_ids/labels [rows, seq] (ids in [low, vocab)) packed with four documents, the same cuts in
    every row, new cuts every ``step``; position_ids restart at each document."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(low, vocab, (rows, seq), generator=gen)
    cuts = sorted(torch.randperm(seq - 2, generator=gen)[:3].add(1).tolist())
    positions = torch.cat([torch.arange(end - start) for start, end in zip([0, *cuts], [*cuts, seq])])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions.expand(rows, seq).clone()}
