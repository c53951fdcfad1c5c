"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) as a :class:`~hybridsp.linear_attention._passing.Recurrence`.

Per value head the state ``S`` is ``[dk, dv]`` and each token maps it to
``exp(g) (I - beta k k^T) S + beta k v^T``: after a run, ``S -> M S + E`` with ``M`` ``[dk, dk]``.
Note [transition by extra columns]: the update acts on the columns of ``S`` independently, so one
call of the chunked kernel on ``v`` widened by ``dk`` zero columns, from the initial state
``[0 | I]``, returns ``[E | M]`` as its final state: the transition costs the kernel on ``dv + dk``
columns instead of ``dv``, and works with any kernel that takes an initial state.

The kernel is the model's own (``chunk_fn``: transformers' ``torch_chunk_gated_delta_rule``, or
flash-linear-attention's ``chunk_gated_delta_rule`` where transformers picked it), called with
its documented keywords; it repeats key heads for the value heads it serves itself.
"""

from __future__ import annotations

from typing import Callable, Literal, overload

import torch

ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
"""The model's chunked kernel: (out [b, n, Hv, dv], final state [b, Hv, dk, dv] or None unless asked)."""


class GatedDeltaRule:
    """Inputs per segment: ``q``, ``k`` [b, n, Hk, dk]; ``v`` [b, n, Hv, dv]; ``g``, ``beta`` [b, n, Hv].

    Pairs are fp32 ``[b, Hv, dk, dv + dk]`` = ``[E | M]``; states ``[b, Hv, dk, dv]``.
    """

    def __init__(self, chunk_fn: ChunkFn, value_dim: int) -> None:
        self.chunk_fn, self.value_dim = chunk_fn, value_dim

    @overload
    def _call(
        self, pieces: dict[str, torch.Tensor], value: torch.Tensor, initial: torch.Tensor | None, final: Literal[True]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def _call(
        self, pieces: dict[str, torch.Tensor], value: torch.Tensor, initial: torch.Tensor | None, final: Literal[False]
    ) -> tuple[torch.Tensor, None]: ...

    def _call(
        self, pieces: dict[str, torch.Tensor], value: torch.Tensor, initial: torch.Tensor | None, final: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.chunk_fn(
            pieces["q"],
            pieces["k"],
            value,
            g=pieces["g"],
            beta=pieces["beta"],
            initial_state=initial,
            output_final_state=final,
            use_qk_l2norm_in_kernel=True,
        )

    def transitions(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        v = pieces["v"]
        m, n, heads, dv = v.shape
        dk = pieces["k"].shape[-1]
        widened = torch.cat([v, v.new_zeros(m, n, heads, dk)], dim=-1)  # [m, n, Hv, dv + dk]
        initial = torch.zeros(m, heads, dk, dv + dk, dtype=torch.float32, device=v.device)
        initial[..., dv:] = torch.eye(dk, dtype=torch.float32, device=v.device)  # [m, Hv, dk, dv + dk] = [0 | I]
        _, final = self._call(pieces, widened, initial, True)
        return final.float()  # [m, Hv, dk, dv + dk] = [E | M]

    def apply(self, pair: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return pair[..., self.value_dim :] @ state + pair[..., : self.value_dim]  # [b, Hv, dk, dv]

    def external(self, pair: torch.Tensor) -> torch.Tensor:
        return pair[..., : self.value_dim]  # [b, Hv, dk, dv]

    def outputs(self, pieces: dict[str, torch.Tensor], initial: torch.Tensor | None) -> torch.Tensor:
        out, _ = self._call(pieces, pieces["v"], initial, False)
        return out  # [m, n, Hv, dv]

    def final_state(self, pieces: dict[str, torch.Tensor], initial: torch.Tensor | None) -> torch.Tensor:
        return self._call(pieces, pieces["v"], initial, True)[1]  # [m, Hv, dk, dv]
