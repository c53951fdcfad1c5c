"""Head-chunked hybrid attention: one call as G passes over head groups (``head_chunks=G``).

After the Ulysses all-to-all a rank holds the whole ring slot (``S/R`` tokens) of its ``H/U``
heads, and the ring's working set on them (the fp32 out/lse accumulators, the K/V blocks in
flight, the kernel's buffers; in backward dout, the fp32 dq/dk/dv accumulators and the visiting
blocks' dK/dV) grows with the heads it runs at once. ``head_chunks=G`` runs the heads in G groups,
one after the other, forward and backward:

    for each group g:  q,k,v heads of g [B, S/C, U, h, D]  --all-to-all-->  [B, S/R, h, D]
                       --ring over R-->  out [B, S/R, h, Dv]  --all-to-all-->  out's heads of g [B, S/C, U, h, Dv]

with ``h = H / (U G)`` query heads and ``hkv / G`` K/V heads of each Ulysses rank per group
(Note [groups along K/V heads]); backward the same loop from dout to dq, dk, dv.

Note [groups along K/V heads]: rank u of the head scatter holds query heads ``[u H/U, (u+1) H/U)``
and K/V heads ``[u Hkv'/U, (u+1) Hkv'/U)`` (Hkv' after :func:`~hybridsp.attention._ulysses.expand_kv_heads_for`).
Group g takes the g-th ``1/G`` of both ranges on every rank, so each query head finds its K/V head
in its own group and no K/V head travels twice: G divides the K/V heads per rank
(:func:`~hybridsp.attention._resolve.resolve_head_chunks` refuses other G before any
communication). The bytes on the wire are G=1's exactly (every tensor is sent once, in G pieces);
only the number of messages grows G-fold.

Note [one function over the groups]: one ``autograd.Function`` runs every group forward, keeps
each group's ring-slot q/k/v buffers, out and lse (together the bytes G=1 keeps: the same
tensors in G pieces), and writes each group's output heads into one output tensor. Its backward
runs the groups in turn, each from its saved slot tensors: one all-to-all of that group's dout,
the ring backward, one all-to-all of its dq/dk/dv into preallocated gradients. So at any time only
one group's transient buffers exist (forward and backward), and neither direction communicates
more than G=1 (a backward that re-ran each group's forward all-to-alls instead of keeping the
slot tensors would send q/k/v/out again). Per-group autograd nodes would free a group's saved
tensors as soon as its backward ends, but the first group to run its backward finds all of them
alive either way, so the peak would not move, and the gradients of head slices of q/k/v would
need an extra gather. Without Ulysses (U = 1) the groups are views of q/k/v and the output.

Note [overlap]: the next group's to-heads all-to-all (q/k/v forward, dout backward) is started
(:mod:`hybridsp.attention._prefetch`, ``async_op=True``) before the current group's ring runs, so it
proceeds during the ring's compute on any transport (NCCL on its own stream, gloo on its worker
thread); the reverse all-to-all of a group's output (or dq/dk/dv) stays synchronous. Memory: the
forward keeps every group's slot buffers for the backward anyway, so fetching one group early costs
only its send buffers; the backward holds one more group's dout slot (1/G of dout) while the current
group runs. Collectives on the Ulysses group are issued in the same order on every rank.

Note [donated inputs]: with ``donate_inputs=True`` and U = 1 the backward writes group g's dq, dk, dv
into group g's heads of the saved q, k, v once that group's ring backward is done (no other group
reads them) and returns q, k, v themselves as the gradients: three ``[B, L, H(kv), D]`` tensors fewer
than preallocated gradients, at the attention backward's peak. A tensor whose storage another of the
three shares (``k is v``, a fused projection's views) is not donated. The writes bump the version
counters, so autograd refuses any later use of the overwritten values; when the caller may donate is
:mod:`hybridsp.memory._qkv_donation`'s question. With U > 1 q, k, v are not kept (the ring-slot
buffers are), so nothing is donated.

Note [token-major out]: the output is one contiguous [B, L, H, Dv] tensor (as G = 1 returns), so a
model's ``out.reshape(B, L, H * Dv)`` before its output projection is a view. With U = 1 this function
keeps ``out`` for backward and the projection keeps its input: token-major, both are one storage (a
heads-first ``out`` made the model's reshape copy it, one more [B, L, H Dv] tensor kept per layer).

Shapes: q [B, L, H, D], k [B, L, Hkv', D], v [B, L, Hkv', Dv] this rank's tokens (K/V already
expanded for the head scatter); out [B, L, H, Dv]; sinks [H] or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from hybridsp.attention._prefetch import PendingHeads, start_seq_to_heads_buffers
from hybridsp.attention._ring_function import ring_backward, ring_forward
from hybridsp.attention._sinks import sink_grad
from hybridsp.attention._ulysses import expand_kv_heads_for, heads_to_seq_plain, split_heads

if TYPE_CHECKING:
    from hybridsp.attention._resolve import RingCall
    from hybridsp.mesh._hybrid_mesh import HybridMesh


@dataclass(frozen=True)
class HeadGroups:
    """How one call's heads split into ``groups`` (Note [groups along K/V heads]): the Ulysses degree
    ``ulysses`` and group (None for U = 1), this rank's place in it, the resolved ring call."""

    call: RingCall
    groups: int
    ulysses: int
    group: dist.ProcessGroup | None
    ulysses_rank: int
    donate: bool = False  # backward may write dq, dk, dv into q, k, v (Note [donated inputs]; U = 1 only)

    def of(self, t: torch.Tensor, g: int) -> torch.Tensor:
        """Group g's heads of a [B, L, H_i, D] tensor: the view [B, L, U, H_i/(U G), D] (U > 1, split per
        destination rank of the head scatter) or [B, L, H_i/G, D] (U = 1)."""
        per_group = t.shape[2] // (self.ulysses * self.groups)
        view: torch.Tensor = t.unflatten(2, (self.ulysses, self.groups, per_group))[:, :, :, g]  # [B, L, U, h_i, D]
        return view if self.ulysses > 1 else view.squeeze(2)  # U = 1: [B, L, h_i, D]

    def sinks_of(self, sinks: torch.Tensor | None, g: int) -> torch.Tensor | None:
        """Group g's sink logits on this rank: [h] of sinks [H]."""
        if sinks is None:
            return None
        per_group = sinks.shape[0] // (self.ulysses * self.groups)
        return sinks.narrow(0, (self.ulysses_rank * self.groups + g) * per_group, per_group)  # [h]

    def start_slot(self, tensors: list[torch.Tensor], g: int) -> Slot:
        """Start moving group g's ``tensors`` to the ring slot (Note [overlap]): one all-to-all per head
        dim and sequence, in flight when this returns (U > 1); for U = 1 the group views themselves."""
        views = [self.of(t, g) for t in tensors]
        if self.ulysses == 1:
            return Slot(views, None)
        assert self.group is not None  # U > 1: the Ulysses group
        return Slot(views, start_seq_to_heads_buffers(views, self.group, self.call.counter))

    def to_seq(self, slot: list[torch.Tensor], into: list[torch.Tensor], g: int) -> None:
        """Each [B, S/R, h_i, D_i] ring-slot tensor of group g into group g's heads of ``into`` [B, L, H_i, D_i]."""
        if self.ulysses == 1:
            for source, target in zip(slot, into):
                self.of(target, g).copy_(source)
            return
        assert self.group is not None  # U > 1: the Ulysses group
        for source, target in zip(slot, into):  # one tensor at a time: one send buffer alive
            (moved,) = heads_to_seq_plain([source], self.group, self.call.counter)  # [B, L, U*h_i, D_i]
            self.of(target, g).copy_(moved.unflatten(2, (self.ulysses, -1)))  # [B, L, U, h_i, D_i]
            del moved


@dataclass
class Slot:
    """A head group's tensors on their way to the ring slot; :meth:`wait` gives (the ring-slot views
    [B, S/R, h_i, D_i], the heads-first buffers [B, sum h_i, S/R, D] they view; none for U = 1)."""

    views: list[torch.Tensor]
    pending: PendingHeads | None

    def wait(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.pending is None:
            return self.views, []
        buffers = self.pending.wait()
        views = self.views
        self.views, self.pending = [], None
        return slot_views(buffers, [v.shape[3] for v in views], [v.shape[-1] for v in views]), buffers


def slot_views(buffers: list[torch.Tensor], heads: list[int], widths: list[int]) -> list[torch.Tensor]:
    """The [B, S, h_i, D_i] views of the heads-first buffers :func:`seq_to_heads_buffers` returns (one per
    distinct head dim, in order of appearance; ``heads`` / ``widths``: each tensor's h_i and D_i)."""
    views: list[torch.Tensor | None] = [None] * len(heads)
    for buffer, width in zip(buffers, dict.fromkeys(widths)):
        members = [i for i, w in enumerate(widths) if w == width]
        for i, view in zip(members, split_heads(buffer, [heads[i] for i in members])):
            views[i] = view
    return cast("list[torch.Tensor]", views)  # every index has one head dim


class HeadChunkedAttention(torch.autograd.Function):
    """Hybrid attention over head groups (Note [one function over the groups])."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, heads: HeadGroups
    ) -> torch.Tensor:
        b, length, num_heads, _ = q.shape
        out = q.new_empty(b, length, num_heads, v.shape[-1])  # [B, L, H, Dv] token-major: Note [token-major out]
        saved: list[torch.Tensor] = []
        counts: list[int] = []
        arriving = heads.start_slot([q, k, v], 0)
        for g in range(heads.groups):
            (q_s, k_s, v_s), buffers = arriving.wait()  # each [B, S/R, h(kv), D(v)]
            if g + 1 < heads.groups:
                arriving = heads.start_slot([q, k, v], g + 1)  # in flight during this group's ring
            out_s, lse = ring_forward(q_s, k_s, v_s, heads.sinks_of(sinks, g), heads.call)  # [B, S/R, h, Dv]
            heads.to_seq([out_s], [out], g)
            kept = [*buffers, lse] if heads.ulysses == 1 else [*buffers, out_s, lse]
            saved += kept
            counts.append(len(kept))
            del q_s, k_s, v_s, out_s, buffers
        if heads.ulysses == 1:
            saved = [q, k, v, out, *saved]  # U = 1: the groups are views of the inputs and the output
        ctx.save_for_backward(*saved, sinks)
        ctx.heads, ctx.counts = heads, counts
        ctx.widths, ctx.kv_heads = (q.shape[-1], v.shape[-1]), k.shape[2]
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        heads: HeadGroups = ctx.heads
        *saved, sinks = ctx.saved_tensors
        if heads.ulysses == 1:
            q, k, v, out, *saved = saved
        else:
            q = k = v = out = None
        dq, dk, dv = _gradient_buffers(dout, ctx.widths[0], ctx.kv_heads, _donated(heads, (q, k, v), ctx))
        dsinks = None if sinks is None or not ctx.needs_input_grad[3] else torch.zeros_like(sinks)
        arriving = heads.start_slot([dout], 0)
        for g, count in enumerate(ctx.counts):
            kept, saved = saved[:count], saved[count:]
            (dout_s,), _ = arriving.wait()  # [B, S/R, h, Dv]
            if g + 1 < len(ctx.counts):
                arriving = heads.start_slot([dout], g + 1)  # in flight during this group's ring backward
            if heads.ulysses == 1:
                assert q is not None and k is not None and v is not None and out is not None
                q_s, k_s, v_s, out_s = (heads.of(t, g) for t in (q, k, v, out))
                lse = kept[0]
            else:
                *buffers, out_s, lse = kept
                heads_q = out_s.shape[2]
                q_s, k_s, v_s = slot_views(buffers, _slot_heads(buffers, heads_q), _slot_widths(ctx.widths))
            grads = ring_backward(dout_s, q_s, k_s, v_s, out_s, lse, heads.call)
            if dsinks is not None:
                group_sinks = heads.sinks_of(sinks, g)
                assert group_sinks is not None
                heads.sinks_of(dsinks, g).copy_(sink_grad(dout_s, out_s, lse, group_sinks))  # type: ignore[union-attr]
            del dout_s, kept
            heads.to_seq(list(grads), [dq, dk, dv], g)
            del grads
        return dq, dk, dv, dsinks, None


def _donated(heads: HeadGroups, inputs: tuple[torch.Tensor | None, ...], ctx: Any) -> list[torch.Tensor | None]:
    """Which of q, k, v hold their own gradients (Note [donated inputs]): each that needs a gradient and
    shares its storage with neither other input; None for the rest."""
    if not heads.donate or heads.ulysses > 1 or torch.is_grad_enabled():  # grad mode: a double backward
        return [None, None, None]
    storages = [t.untyped_storage().data_ptr() if t is not None else None for t in inputs]
    return [
        t if t is not None and ctx.needs_input_grad[i] and storages.count(storages[i]) == 1 else None
        for i, t in enumerate(inputs)
    ]


def _gradient_buffers(
    dout: torch.Tensor, head_dim: int, kv_heads: int, donated: list[torch.Tensor | None]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [B, L, H, D], dk [B, L, Hkv', D], dv [B, L, Hkv', Dv] that the groups fill: the donated input
    where there is one, else an empty tensor (heads-first storage)."""
    b, length, num_heads, v_head_dim = dout.shape
    shapes = [(num_heads, head_dim), (kv_heads, head_dim), (kv_heads, v_head_dim)]

    def buffer(donor: torch.Tensor | None, h: int, width: int) -> torch.Tensor:
        if donor is not None:
            return donor  # [B, L, h, width]: Note [donated inputs]
        return dout.new_empty(b, h, length, width).transpose(1, 2)  # [B, L, h, width]

    dq, dk, dv = (buffer(donor, h, width) for donor, (h, width) in zip(donated, shapes))
    return dq, dk, dv


def _slot_heads(buffers: list[torch.Tensor], heads_q: int) -> list[int]:
    """q's, k's and v's heads in a group's heads-first buffers (q h, then K/V hkv each)."""
    total = sum(buffer.shape[1] for buffer in buffers)
    hkv = (total - heads_q) // 2
    return [heads_q, hkv, hkv]


def _slot_widths(widths: tuple[int, int]) -> list[int]:
    return [widths[0], widths[0], widths[1]]


def head_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    call: RingCall,
    mesh: HybridMesh,
    sinks: torch.Tensor | None,
    donate: bool = False,
) -> torch.Tensor:
    """:func:`~hybridsp.attention._api.hybrid_attn_func` of a resolved call with ``call.head_chunks`` > 1:
    q [B, L, H, D], k [B, L, Hkv, D], v [B, L, Hkv, Dv] -> out [B, L, H, Dv] (differentiable in q, k, v, sinks);
    ``donate``: backward may write the gradients into q, k, v (Note [donated inputs])."""
    u = mesh.ulysses
    if u > 1:
        k, v = expand_kv_heads_for(k, q.shape[2], u), expand_kv_heads_for(v, q.shape[2], u)  # [B, L, Hkv', D(v)]
    heads = HeadGroups(
        call,
        call.head_chunks,
        u,
        mesh.ulysses_group if u > 1 else None,
        dist.get_rank(mesh.ulysses_group) if u > 1 else 0,
        donate,
    )
    return cast(torch.Tensor, HeadChunkedAttention.apply(q, k, v, sinks, heads))
