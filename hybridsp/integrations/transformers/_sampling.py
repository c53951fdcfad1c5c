"""Choosing the next token for :func:`hybridsp.integrations.transformers.generate`: greedy or sampled
(transformers' warpers' rules), and the EOS / pad ids (Note [EOS and padding of finished rows] in
:mod:`hybridsp.integrations.transformers._generation`). No communication.
"""

from __future__ import annotations

import enum

import torch
from torch import nn


class Default(enum.Enum):
    """The default of ``eos_token_id`` / ``pad_token_id``: not passed, so the model's ``generation_config``
    decides; ``None`` passed explicitly means none (as ``model.generate``'s keyword arguments)."""

    FROM_GENERATION_CONFIG = "the model's generation_config"

    def __repr__(self) -> str:
        return "FROM_GENERATION_CONFIG"


FROM_GENERATION_CONFIG = Default.FROM_GENERATION_CONFIG


def choose_next_tokens(
    logits: torch.Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax, or a draw after temperature, top-k and top-p (in that order).

    The filters follow transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
    ``TopPLogitsWarper`` (the nucleus keeps the smallest set of most likely tokens whose
    probability reaches ``top_p``, at least one), then one ``torch.multinomial`` draw per row.
    """
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature  # [B, V]
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        scores = scores.masked_fill(scores < kth, -torch.inf)
    if top_p < 1.0:
        ordered, order = scores.sort(dim=-1)  # ascending [B, V]
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(1, order, drop), -torch.inf)
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)


def check_sampling(do_sample: bool, temperature: float, top_k: int | None, top_p: float) -> None:
    if not do_sample:
        return
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling; got {temperature} (use do_sample=False for greedy)")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1; got {top_k!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p}")


def eos_ids(model: nn.Module, eos_token_id) -> list[int]:
    """The EOS ids: the generation config's when not passed (``FROM_GENERATION_CONFIG``); none for ``None``
    or ``[]`` passed (``model.generate`` keeps generating then)."""
    if eos_token_id is FROM_GENERATION_CONFIG:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them; got {eos_token_id!r}")
    return ids


def pad_id(model: nn.Module, pad_token_id, eos: list[int]) -> int | None:
    """The id that fills finished rows: the generation config's when not passed, then (also for ``None``
    passed) the first EOS, as ``model.generate``."""
    if pad_token_id is FROM_GENERATION_CONFIG:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    return pad_token_id
