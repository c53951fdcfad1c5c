"""The Mamba-2 selective scan (Nemotron-H) as a :class:`~hybridsp.linear_attention._passing.Recurrence`.

Per head the state ``S`` is ``[P, N]`` and each token maps it to ``exp(A dt) S + dt x B^T``: after
a run, ``S -> a S + E`` with the scalar decay ``a = exp(A * sum dt)`` per head. ``dt`` is the
model's: ``clamp(softplus(dt + dt_bias), dt_limit)``.

The kernel is the model's own chunked scan (``scan_fn``: transformers' ``mamba2_chunk_scan``),
called with its documented keywords; ``D``'s skip term is added by the kernel in the outputs.
"""

from __future__ import annotations

from typing import Callable, Literal, overload

import torch
import torch.nn.functional as F

ScanFn = Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
"""The model's chunked scan: out [b, n, H, P], or (out, final states [b, H, P, N]) when asked."""


class Mamba2Scan:
    """Inputs per segment: ``x`` [b, n, H, P]; ``dt`` [b, n, H] (before bias); ``B``, ``C`` [b, n, G, N].

    Pairs are fp32 ``[b, H, P, N + 1]`` = ``[E | a]`` (the decay repeated over P); states ``[b, H, P, N]``.
    """

    def __init__(
        self,
        scan_fn: ScanFn,
        A: torch.Tensor,
        D: torch.Tensor,
        dt_bias: torch.Tensor,
        dt_limit: tuple[float, float],
        chunk_size: int,
        state_size: int,
    ) -> None:
        self.scan_fn, self.A, self.D, self.dt_bias = scan_fn, A, D, dt_bias
        self.dt_limit, self.chunk_size, self.state_size = dt_limit, chunk_size, state_size

    @overload
    def _call(
        self,
        pieces: dict[str, torch.Tensor],
        D: torch.Tensor | None,
        initial: torch.Tensor | None,
        final: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def _call(
        self,
        pieces: dict[str, torch.Tensor],
        D: torch.Tensor | None,
        initial: torch.Tensor | None,
        final: Literal[False],
    ) -> torch.Tensor: ...

    def _call(
        self, pieces: dict[str, torch.Tensor], D: torch.Tensor | None, initial: torch.Tensor | None, final: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.scan_fn(
            pieces["x"],
            pieces["dt"],
            self.A,
            pieces["B"],
            pieces["C"],
            chunk_size=self.chunk_size,
            D=D,
            dt_bias=self.dt_bias,
            initial_states=initial,
            dt_softplus=True,
            dt_limit=self.dt_limit,
            return_final_states=final,
        )

    def transitions(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        _, final = self._call(pieces, None, None, True)  # [m, H, P, N]
        steps = F.softplus(pieces["dt"].float() + self.dt_bias.float()).clamp(*self.dt_limit)  # [m, n, H]
        decay = torch.exp(self.A.float() * steps.sum(dim=1))  # [m, H]
        decay = decay[:, :, None, None].expand(*final.shape[:3], 1)  # [m, H, P, 1]
        return torch.cat([final.float(), decay], dim=-1)  # [m, H, P, N + 1]

    def apply(self, pair: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return pair[..., self.state_size :] * state + pair[..., : self.state_size]  # [b, H, P, N]

    def external(self, pair: torch.Tensor) -> torch.Tensor:
        return pair[..., : self.state_size]  # [b, H, P, N]

    def outputs(self, pieces: dict[str, torch.Tensor], initial: torch.Tensor | None) -> torch.Tensor:
        return self._call(pieces, self.D, initial, False)  # [m, n, H, P]

    def final_state(self, pieces: dict[str, torch.Tensor], initial: torch.Tensor | None) -> torch.Tensor:
        return self._call(pieces, self.D, initial, True)[1]  # [m, H, P, N]
