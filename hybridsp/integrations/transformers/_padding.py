"""A 2-D padding ``attention_mask`` (and packed ``position_ids``) -> per-row document boundaries.

A switched model has no mask tensor (Note [no mask] in :mod:`hybridsp.integrations.transformers`);
what a 2-D Hugging Face padding mask means is expressed instead as documents of the hybrid
attention, over the *global* (unsharded) sequence of each row:

    mask      0 0 0 1 1 1 1 1        left padding
    position  0 0 0 0 1 2 0 1        (optional) a packed row: restarts at 0 start documents
    segments  [0 3) [3 6) [6 8)      the pads are their own segment; real tokens never see them

A segment starts at each row's first token, wherever the mask changes (0 -> 1 or 1 -> 0) and
wherever ``position_ids`` is 0. Every real token then attends exactly to the earlier real
tokens of its own document, which is what the unmodified model computes with the same 2-D
mask (for an unpacked row), and is exact on every real token; what padded query rows produce
is unspecified (the model's own output there differs too) and no loss should read them.

Note [holes]: a row whose real tokens resume after padding in the middle (``1 1 0 0 1 1``)
would need the later tokens to see the earlier ones across the pads: not a set of segments.
It is accepted only where the resumed tokens begin a new packed document (``position_ids``
restart at 0 there: padding between packed documents) and refused with a ValueError otherwise.

:func:`padded_documents` is pure (no communication; tensors of the whole rows);
:func:`flattened_boundaries` turns its rows into transformers' flattened ``cu_seq_lens`` form.
"""

from __future__ import annotations

import torch


def padded_documents(
    attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
) -> list[torch.Tensor] | None:
    """Per-row global document boundaries for a 2-D padding mask (module docstring), or None.

    Args:
        attention_mask: [B, S] of 0/1 (bool or any number type) over the whole rows; 1 = real token.
        position_ids: [B, S] or [1, S] positions of the same tokens, or None (then only the mask
            makes segments). A 0 starts a new document.

    Returns:
        B int64 tensors ``[0, ..., S]`` (each ``[n_b + 1]``), the form :func:`hybridsp.hybrid_attn_func`
        takes as ``cu_seqlens``; None when every row is a single segment (no padding, no packing).

    Raises:
        ValueError for values other than 0/1, shapes that disagree, or a hole (Note [holes]).
    """
    real = _checked_mask(attention_mask)  # [B, S] bool
    batch, seq = real.shape
    starts = torch.zeros_like(real)  # [B, S] bool: a segment begins here
    starts[:, 0] = True
    starts[:, 1:] = real[:, 1:] != real[:, :-1]
    restarts = torch.zeros_like(real) if position_ids is None else _restarts(position_ids, batch, seq)  # [B, S]
    _refuse_holes(real, starts, restarts)
    starts |= restarts
    if int(starts.sum()) == batch:
        return None
    end = torch.tensor([seq], dtype=torch.long)
    return [torch.cat([row.nonzero().flatten().long().cpu(), end]) for row in starts]  # B x [n_b + 1]


def flattened_boundaries(rows: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """B rows of per-row boundaries -> one int64 ``[N + 1]`` over the flattened ``B x S`` tokens
    (row ``b`` at ``[b S, (b + 1) S)``): transformers' ``cu_seq_lens_q/k`` form."""
    flat = [row[:-1] + index * seq_len for index, row in enumerate(rows)]  # each [n_b]
    return torch.cat(flat + [torch.tensor([len(rows) * seq_len], dtype=torch.long)]).long()  # [N + 1]


def _checked_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
        raise ValueError(f"a padding attention_mask must be a 2-D tensor [B, S] of 0/1; got {shape}")
    if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
        values = sorted(attention_mask.unique().tolist())[:6]
        raise ValueError(
            f"attention_mask must hold only 0 (padding) and 1 (real token); got values {values}. Pass a 2-D "
            f"padding mask; packed documents are given by position_ids restarting at 0"
        )
    return attention_mask.bool()


def _restarts(position_ids: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """[B, S] bool: position 0 (a packed document begins)."""
    positions = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
    if positions.dim() != 2 or positions.shape[1] != seq or positions.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids {tuple(position_ids.shape)} must be [B, S] or [1, S] for an attention_mask of "
            f"shape ({batch}, {seq})"
        )
    return (positions == 0).expand(batch, seq).to(positions.device)


def _refuse_holes(real: torch.Tensor, starts: torch.Tensor, restarts: torch.Tensor) -> None:
    """ValueError for real tokens that resume after padding without starting a new document."""
    earlier_real = (real.long().cumsum(1) - real.long()) > 0  # [B, S]: some real token before this one
    resumed = real & starts & earlier_real & ~restarts.to(real.device)  # [B, S]
    if not bool(resumed.any()):
        return
    row, index = (int(i) for i in resumed.nonzero()[0])
    pads = int((~real[row, :index]).flip(0).long().cumprod(0).sum())  # the pad run just before it
    raise ValueError(
        f"attention_mask row {row} has {pads} padding token(s) at indices {index - pads}..{index - 1} between real "
        f"tokens: hybridsp can mask left padding, right padding and padding between packed documents, not a hole "
        f"inside one sequence. Remove the hole, or, if the tokens from index {index} on are a new document, "
        f"restart position_ids at 0 there"
    )


def padded_cu_seq_lens(attention_mask: torch.Tensor, position_ids: torch.Tensor | None, mesh) -> torch.Tensor | None:
    """Flattened global boundaries (int64 ``[N + 1]`` over the unsharded ``B x S`` tokens) of this rank's
    2-D ``attention_mask`` [B, S/C] and ``position_ids`` [B, S/C] (or None on a 1 x 1 mesh): the
    transformers hook's form. None when no row is padded or packed.

    One ``all_gather`` of ``[B, S/C, 2]`` int64 over ``mesh.context_group`` when ``C > 1`` (every
    context rank must call it); ValueError, before it, when the mask is not this rank's shard.
    """
    from hybridsp.attention._api import gather_sequence

    if position_ids is not None and tuple(attention_mask.shape) != tuple(position_ids.shape):
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must have the shape of this rank's position_ids "
            f"{tuple(position_ids.shape)}: pass the mask's shard (hybridsp.shard_sequence(mask, mesh)), not the "
            f"whole rows"
        )
    positions: torch.Tensor | None
    if mesh.context > 1:
        assert position_ids is not None  # C > 1: the model's input check refused a call without them
        local = torch.stack([attention_mask.long(), position_ids.long()], dim=-1)  # [B, S/C, 2]
        full = gather_sequence(local, mesh)  # [B, S, 2]
        mask, positions = full[..., 0], full[..., 1]  # [B, S] each
    else:
        mask, positions = attention_mask, position_ids
    rows = padded_documents(mask, positions)
    return None if rows is None else flattened_boundaries(rows, mask.shape[1])


# --------------------------------------------------------------------------- left-padded prompts (generate)


def left_padding_mask(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The prompt's mask as bool [B, S], or None when absent or all ones; ValueError (before any
    collective) unless it is a 0/1 mask of input_ids' shape, every row ``0 ... 0 1 ... 1`` with a real token."""
    if attention_mask is None:
        return None
    if not torch.is_tensor(attention_mask) or tuple(attention_mask.shape) != tuple(input_ids.shape):
        shape = tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a [B, S] tensor like input_ids {tuple(input_ids.shape)}; got {shape}")
    if attention_mask.dtype != torch.bool and not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError(
            f"attention_mask must hold 0 (padding) and 1 (real token); got values "
            f"{sorted(attention_mask.unique().tolist())[:6]}"
        )
    mask = attention_mask.bool().to(input_ids.device)  # [B, S]
    drops = (mask[:, :-1] & ~mask[:, 1:]).nonzero()
    if drops.numel():
        row, index = (int(i) for i in drops[0])
        raise ValueError(
            f"attention_mask row {row} has padding at index {index + 1} after a real token: generate takes left-padded "
            f"prompts (tokenizer.padding_side = 'left'), as model.generate expects"
        )
    empty = (~mask.any(1)).nonzero()
    if empty.numel():
        raise ValueError(f"attention_mask row {int(empty[0])} has no real token; drop empty prompts")
    return None if bool(mask.all()) else mask


def left_padded_inputs(mask: torch.Tensor, seq_pad: int, mine: torch.Tensor) -> dict:
    """This rank's ``position_ids`` (transformers' ``cumsum(mask) - 1``, 0 on the padding) and
    ``attention_mask`` shards for a left-padded prompt of mask [B, S], padded to ``seq_pad``; ``mine``
    [S_pad/C] the indices this rank holds (Note [left padding] in :mod:`hybridsp.integrations.transformers._generation`)."""
    real = torch.nn.functional.pad(mask, (0, seq_pad - mask.shape[1]), value=False)  # [B, S_pad]
    positions = (real.long().cumsum(1) - 1).clamp_min(0)  # [B, S_pad]
    positions[:, mask.shape[1] :] = torch.arange(mask.shape[1], seq_pad, device=mask.device)  # layout padding
    return {"position_ids": positions[:, mine], "attention_mask": real[:, mine].long()}  # each [B, S_pad/C]
