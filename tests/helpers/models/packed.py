"""Packed rows for the transformers tests and their reference: the unmodified model run on each document by itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_batch(rows: tuple[tuple[int, ...], ...], seq: int, seed: int = 0, vocab: int = 128) -> dict:
    """input_ids/labels [B, S] and position_ids restarting at 0 at every document (labels = ids)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(rows), seq), generator=gen)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])  # [B, S]
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": positions}


def per_document_reference(model, batch, rows):
    """(logits [B, S, V], loss, grads) of the unmodified model run on every document by itself;
    the loss averages next-token cross-entropy over all targets inside documents."""
    model.zero_grad(set_to_none=True)
    ids = batch["input_ids"]
    logits = torch.zeros(*ids.shape, model.config.vocab_size)
    total, count = 0.0, 0
    for b, lengths in enumerate(rows):
        start = 0
        for length in lengths:
            doc = ids[b : b + 1, start : start + length]  # [1, n]
            out = model(input_ids=doc, use_cache=False).logits  # [1, n, V]
            logits[b, start : start + length] = out[0].detach()
            total = total + F.cross_entropy(out[0, :-1], doc[0, 1:], reduction="sum")
            count += length - 1
            start += length
    loss = total / count
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
