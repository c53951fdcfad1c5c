"""Packed rows of documents for the tests and benchmarks, generated here (independent of hybridsp)."""

from __future__ import annotations

import math
import random

import torch


def lognormal_pack(seq_len: int, seed: int) -> tuple[int, ...]:
    """Lengths exp(N(6.4, 1.2)) clipped to [16, 8000], the last one truncated at S."""
    rng = random.Random(1000 + seed)
    bounds = [0]
    while bounds[-1] < seq_len:
        bounds.append(min(seq_len, bounds[-1] + min(8000, max(16, round(math.exp(rng.gauss(6.4, 1.2)))))))
    return tuple(bounds)


def packed_lm_batch(step: int, seq: int, *, rows: int = 2, vocab: int = 128, low: int = 3) -> dict:
    """input_ids/labels [rows, seq] (ids in [low, vocab)) packed with four documents, the same cuts in
    every row, new cuts every ``step``; position_ids restart at each document."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(low, vocab, (rows, seq), generator=gen)
    cuts = sorted(torch.randperm(seq - 2, generator=gen)[:3].add(1).tolist())
    positions = torch.cat([torch.arange(end - start) for start, end in zip([0, *cuts], [*cuts, seq])])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions.expand(rows, seq).clone()}
