"""The recurrent layers' states for generation: filled by the sharded prefill, stepped locally in decode.

Note [where the decode states live]: a decode step brings one new token, the same on every
context rank (its hidden state is replicated; the attention layers read their sharded K/V cache
through one merge per layer). A recurrent layer needs only two things of the prompt to continue
it: the state after the last prompt token and the last ``K - 1`` pre-conv inputs. Both are small
(``B x H x dk x dv`` and ``B x (K - 1) x C``, independent of the prompt length), so after the
prefill every context rank keeps a replica of both, for all heads, and each decode step updates
them locally with the model's own single-step math: no communication in decode, and no rank
waits for another's state. The prefill builds them with one all-reduce each over the context
group (each rank contributes the part it holds, zeros elsewhere; a sum of one value and zeros is
exact):

- the final state: the ring slot holding the last prompt token reruns that token's run from its
  chained initial state (:func:`~hybridsp.linear_attention._passing.pass_states` gives it) up to the token,
  for its Ulysses head slice (:func:`prompt_final_state`); stopping at the last *prompt* token
  keeps the layout's right padding out of the state;
- the conv tail: whichever ranks hold the prompt's last ``K - 1`` tokens contribute their
  pre-conv inputs (:func:`prompt_conv_tail`), all channels (before the head split).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridsp.linear_attention._segments import ChainedStates, run_of
from hybridsp.linear_attention._slots import SlotCall
from hybridsp.mesh._hybrid_mesh import HybridMesh

if TYPE_CHECKING:
    from hybridsp.linear_attention._passing import Recurrence


class LinearStates:
    """The prompt's recurrent layers' states on this rank (Note [where the decode states live]).

    ``prompt_length``: S, the real prompt tokens. ``positions``: [S_pad / C] int64, the global
    positions of this rank's prefill tokens. ``layers``: layer index -> (conv tail [B, K - 1, C],
    state [B, H, ...] fp32), every head, filled by the prefill and updated in place of the dict by
    each decode step.
    """

    def __init__(self, prompt_length: int, positions: torch.Tensor) -> None:
        self.prompt_length, self.positions = prompt_length, positions
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"LinearStates(prompt_length={self.prompt_length}, layers={sorted(self.layers)})"


def _context_sum(x: torch.Tensor, mesh: HybridMesh) -> torch.Tensor:
    if mesh.context > 1:
        dist.all_reduce(x, group=mesh.context_group)
    return x


def prompt_conv_tail(pre: torch.Tensor, store: LinearStates, kernel: int, mesh: HybridMesh) -> torch.Tensor:
    """The prompt's last ``kernel - 1`` pre-conv inputs on every rank (zeros before the prompt).

    Args:
        pre: [B, L, C] this rank's prefill tokens' pre-conv inputs, every channel.

    Returns:
        [B, K - 1, C] in ``pre``'s dtype, a collective over the context group.
    """
    targets = torch.arange(store.prompt_length - kernel + 1, store.prompt_length, device=pre.device)  # [K - 1]
    hits = targets[:, None] == store.positions.to(pre.device)[None, :]  # [K - 1, L]
    tail = torch.einsum("jl,blc->bjc", hits.to(pre.dtype), pre)  # [B, K - 1, C] (one hit per target at most)
    return _context_sum(tail.contiguous(), mesh)


def prompt_final_state(
    recurrence: Recurrence,
    inputs: dict[str, torch.Tensor],
    call: SlotCall,
    chained: ChainedStates,
    store: LinearStates,
    heads: slice,
    total_heads: int,
    mesh: HybridMesh,
) -> torch.Tensor:
    """The state after the last prompt token, every head, on every rank (a collective).

    Args:
        recurrence: the layer's :class:`~hybridsp.linear_attention._passing.Recurrence` (with ``final_state``).
        inputs: name -> [B, Ls, ...] the slot's tokens in slot order, this rank's heads.
        call: the prefill's :class:`SlotCall` (one document per row: one row group).
        chained: ``{(slot, run): initial state or None}`` from :func:`~hybridsp.linear_attention._passing.pass_states`.
        heads: this rank's heads among ``total_heads``.

    Returns:
        fp32 [B, total_heads, ...].
    """
    [group] = call.rows  # the prefill gives every row one document
    last = store.prompt_length - 1
    slot, run, _ = run_of(group.plan, last)
    state: torch.Tensor | None = None
    if slot == call.slot:
        [seg] = [s for s in group.plan.segments[slot] if s.run == run and s.start <= last < s.start + s.length]
        end = seg.offset + last - seg.start + 1
        pieces = {name: x[:, seg.offset : end] for name, x in inputs.items()}
        state = recurrence.final_state(pieces, chained[(slot, run)] if seg.chained else None).float()  # [B, h, ...]
    like = (
        state
        if state is not None
        else recurrence.final_state({name: x[:, :1] for name, x in inputs.items()}, None).float()
    )  # the shape (this rank holds no part)
    full = like.new_zeros(like.shape[0], total_heads, *like.shape[2:])  # [B, H, ...]
    if state is not None:
        full[:, heads] = state
    return _context_sum(full, mesh)


def conv_step(
    tail: torch.Tensor, new: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal depthwise conv step: tail [B, K - 1, C] and new [B, 1, C] -> (out [B, 1, C] in weight's
    dtype, before the activation; the next tail [B, K - 1, C])."""
    window = torch.cat([tail, new.to(tail.dtype)], dim=1)  # [B, K, C]
    out = (window.to(weight.dtype) * weight.t()[None]).sum(dim=1, keepdim=True)  # [B, 1, C]
    return (out if bias is None else out + bias), window[:, 1:]
