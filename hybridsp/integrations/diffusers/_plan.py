"""Which tokens each context rank holds, per forward: any token count, text and image streams.

A diffusion transformer has one or two token streams (``"img"``: latent patches; ``"txt"``: text
tokens of joint attention). Each rank holds ``L_s`` slots of stream ``s``; a slot holds a real
token or a pad. Joint attention concatenates a rank's slots as ``[txt slots, img slots]``; the
hybrid attention sees ``N = C * sum(L_s)`` tokens whose global positions the mesh's layout gives.

Note [pads as a document]: exact attention over a padded sequence needs the pads invisible as keys.
``hybrid_attn_func`` masks by documents, contiguous runs of global positions. So the plan puts the
``M`` real tokens exactly on the positions ``[0, M)``: it counts how many of those positions the
layout gives each rank (``m_k``), gives rank ``k`` that many real tokens (split between its text and
image slots), and the attention call reorders each rank's slots so that its real tokens sit on
those positions. The pads are the second document ``[M, N)``: no real token sees them, and their
outputs are dropped. Text tokens that the user's mask hides are never placed (they cannot change
any image token: they are keys nobody sees); they become pads.

Note [non-causal layouts]: a query sees every key of its document, so every slot does the same
work whatever positions it holds; the contiguous layout is balanced, and zigzag is balanced too
(it only reorders). The layout still fixes which positions are real, so both work; the balanced
(document) layout is refused (it moves tokens by document boundaries the model does not have).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridsp.mesh import HybridMesh

PAD_GROWTH_LIMIT = 64  # how many extra slots per stream the plan may add to fit the layout


@dataclass(frozen=True)
class StreamSlots:
    """One stream's slots: ``index`` [C, L] int64 holds the stream token of each rank's slot, or
    ``length`` (one past the last token) for a pad."""

    name: str
    length: int
    index: torch.Tensor

    @property
    def local(self) -> int:
        return int(self.index.shape[1])

    def real(self, rank: int) -> torch.Tensor:
        """[L] bool: which of ``rank``'s slots hold a real token."""
        return self.index[rank] < self.length


@dataclass(frozen=True)
class TokenPlan:
    """One forward's placement: the streams in joint order, and this rank's attention reorder.

    ``order`` [Lj]: the slot (in ``[txt, img]`` order) that sits at each local attention position;
    ``restore`` its inverse; ``cu_seqlens`` [3] = ``(0, M, N)`` when there are pads, else None.
    """

    streams: tuple[StreamSlots, ...]
    rank: int
    order: torch.Tensor
    restore: torch.Tensor
    cu_seqlens: torch.Tensor | None

    def stream(self, name: str) -> StreamSlots:
        for slots in self.streams:
            if slots.name == name:
                return slots
        raise ValueError(f"this model has no {name!r} token stream (streams: {[s.name for s in self.streams]})")

    @property
    def joint_local(self) -> int:
        return sum(s.local for s in self.streams)

    def local_real(self) -> torch.Tensor:
        """[Lj] bool: this rank's real slots in ``[txt, img]`` order."""
        return torch.cat([s.real(self.rank) for s in self.streams])


def layout_positions(mesh: HybridMesh, joint_local: int) -> torch.Tensor:
    """[C, Lj] int64: the global position of each rank's local slot under the mesh's layout.

    Ring slot ``r`` holds its runs in order; its U ranks hold consecutive equal pieces of them
    (rank ``r * U + u``: the layout's shard order)."""
    total = mesh.context * joint_local
    runs = mesh.token_layout.slot_runs(total, mesh.ring)
    flat = torch.cat([torch.arange(start, start + length) for slot in runs for start, length in slot])  # [N]
    return flat.view(mesh.context, joint_local)  # [C, Lj]


def build_plan(mesh: HybridMesh, real: dict[str, torch.Tensor]) -> TokenPlan:
    """The placement of streams ``real`` ({name: [T] bool, True for a token to place}, in joint order).

    No communication: every rank computes the same plan from the same full inputs.
    """
    names = list(real)
    counts = {name: int(mask.sum()) for name, mask in real.items()}
    context = mesh.context
    local = {name: max(1, -(-counts[name] // context)) for name in names}
    multiple = mesh.token_layout.required_multiple(mesh.ring, mesh.ulysses, mesh.kv_chunks)
    for _ in range(PAD_GROWTH_LIMIT * len(names) + multiple):
        joint = sum(local.values())
        if (context * joint) % multiple:
            local[names[-1]] += 1  # the layout needs N to be a multiple of its step
            continue
        positions = layout_positions(mesh, joint)  # [C, Lj]
        per_rank = (positions < sum(counts.values())).sum(dim=1).tolist()  # m_k real tokens on rank k
        shares = _split_counts(per_rank, [counts[n] for n in names], [local[n] for n in names])
        if shares is not None:
            return _plan(mesh, real, local, positions, shares)
        grow = names[0] if len(names) > 1 and local[names[0]] < local[names[-1]] else names[-1]
        local[grow] += 1
    raise ValueError(f"no placement of {counts} tokens over {context} context ranks was found; report this")


def _split_counts(per_rank: list[int], totals: list[int], slots: list[int]) -> list[list[int]] | None:
    """Per rank, how many real tokens of each stream (at most ``slots[s]``) make up its ``per_rank[k]``,
    with stream totals ``totals``; None if impossible. One stream: itself; two: text first."""
    if len(totals) == 1:
        return [[m] for m in per_rank] if max(per_rank) <= slots[0] else None
    low = [max(0, m - slots[1]) for m in per_rank]
    high = [min(slots[0], m) for m in per_rank]
    if any(lo > hi for lo, hi in zip(low, high)) or not sum(low) <= totals[0] <= sum(high):
        return None
    first, left = list(low), totals[0] - sum(low)
    for k, hi in enumerate(high):
        extra = min(left, hi - first[k])
        first[k] += extra
        left -= extra
    return [[t, m - t] for t, m in zip(first, per_rank)]


def _plan(
    mesh: HybridMesh,
    real: dict[str, torch.Tensor],
    local: dict[str, int],
    positions: torch.Tensor,
    shares: list[list[int]],
) -> TokenPlan:
    """The plan once the per-rank shares are known (``positions`` [C, Lj])."""
    streams = []
    for s, (name, mask) in enumerate(real.items()):
        tokens = torch.nonzero(mask.cpu(), as_tuple=False).flatten()  # [R_s] the tokens to place, in order
        index = torch.full((mesh.context, local[name]), mask.numel(), dtype=torch.int64)  # [C, L_s]
        start = 0
        for k, share in enumerate(shares):
            index[k, : share[s]] = tokens[start : start + share[s]]
            start += share[s]
        streams.append(StreamSlots(name, mask.numel(), index))
    rank = mesh.context_rank
    slot_real = torch.cat([slots.real(rank) for slots in streams])  # [Lj]
    placed = sum(int(m.sum()) for m in real.values())  # M: the real tokens of all ranks
    position_real = positions[rank] < placed  # [Lj]
    order = torch.empty_like(positions[rank])
    order[position_real] = torch.nonzero(slot_real).flatten()
    order[~position_real] = torch.nonzero(~slot_real).flatten()
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    total = positions.numel()
    bounds = None if placed == total else torch.tensor([0, placed, total], dtype=torch.int32)
    return TokenPlan(tuple(streams), rank, order, restore, bounds)
