"""The attention calls of a switched transformer, routed to ``hybrid_attn_func`` through diffusers' dispatch.

diffusers' processors call ``dispatch_attention_fn(q, k, v, ..., parallel_config=self._parallel_config)``
for exactly the calls its own context parallelism shards (self-attention and joint attention; a Wan
cross-attention to text passes None and stays local: each rank's queries see all text keys). The
switch sets each processor's ``_parallel_config`` to a :class:`Route` and puts a :class:`Router` in
place of the processor module's ``dispatch_attention_fn``: a call that carries a ``Route`` runs
hybrid attention, every other call (other models, the local cross-attention) runs diffusers' own
function unchanged. The router counts its users and is taken out when the last switch is undone.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from hybridsp._types import BackendName
from hybridsp.attention import hybrid_attn_func
from hybridsp.integrations.diffusers._plan import TokenPlan
from hybridsp.mesh import HybridMesh

DISPATCH_NAME = "dispatch_attention_fn"


class ForwardState:
    """The plan of the transformer's current forward (set by the switch's pre-hook, read per call)."""

    def __init__(self) -> None:
        self.plan: TokenPlan | None = None

    def current(self) -> TokenPlan:
        if self.plan is None:
            raise ValueError(
                "a switched attention ran outside the switched transformer's forward; call the transformer"
            )
        return self.plan


class Route:
    """What a switched processor passes as ``parallel_config``: the mesh, the backend, the forward's plan."""

    def __init__(self, mesh: HybridMesh, backend: BackendName, state: ForwardState) -> None:
        self.mesh, self.backend, self.state = mesh, backend, state

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """q [B, Lj, H, D], k/v [B, Lj, Hkv, D] this rank's slots in ``[txt, img]`` order -> [B, Lj, H, D]."""
        plan = self.state.current()
        _check_call(plan, query, attn_mask, dropout_p, is_causal)
        order = plan.order.to(query.device)
        q, k, v = (t.index_select(1, order) for t in (query, key, value))  # [B, Lj, H, D] in position order
        out = hybrid_attn_func(
            q, k, v, mesh=self.mesh, causal=False, cu_seqlens=plan.cu_seqlens, softmax_scale=scale, backend=self.backend
        )
        return out.index_select(1, plan.restore.to(out.device))  # [B, Lj, H, D] back in slot order


def _check_call(
    plan: TokenPlan, query: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool
) -> None:
    """Refuse, before any collective, an attention call the switch cannot make exact."""
    if is_causal:
        raise ValueError("causal attention is not what a diffusion transformer's switch shards; remove is_causal")
    if dropout_p:
        raise ValueError(f"attention dropout {dropout_p} cannot be reproduced across ranks; set it to 0")
    if query.shape[1] != plan.joint_local:
        raise ValueError(
            f"a routed attention call has {query.shape[1]} tokens, but this rank holds {plan.joint_local} "
            f"({', '.join(f'{s.name} {s.local}' for s in plan.streams)}); this processor is not supported"
        )
    if attn_mask is None:
        return
    keys = attn_mask.reshape(attn_mask.shape[0], -1)  # [B, Lj]: a key mask
    if attn_mask.dtype != torch.bool or keys.shape[1] != plan.joint_local:
        raise ValueError(
            f"only a boolean key mask [B, 1, 1, S] is supported; got {attn_mask.dtype} {tuple(attn_mask.shape)}"
        )
    real = plan.local_real().to(keys.device)  # [Lj]: pads are hidden by the documents whatever the mask says
    if not bool(keys[:, real].all()):
        raise ValueError("the attention mask hides a token the switch placed as visible; only text masks are supported")


class Router:
    """``dispatch_attention_fn`` of one diffusers module, routing calls that carry a :class:`Route`."""

    def __init__(self, original: Callable[..., torch.Tensor]) -> None:
        self.original, self.users = original, 0

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        backend: Any = None,
        parallel_config: Any = None,
    ) -> torch.Tensor:
        if isinstance(parallel_config, Route):
            if attention_kwargs:
                raise ValueError(f"attention_kwargs {sorted(attention_kwargs)} are not supported by the switch")
            return parallel_config.attend(query, key, value, attn_mask, dropout_p, is_causal, scale)
        return self.original(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            attention_kwargs,
            backend=backend,
            parallel_config=parallel_config,
        )


def install_router(module: types.ModuleType) -> Callable[[], None]:
    """Put a :class:`Router` in ``module`` (or count one more user of the one there); returns the undo."""
    current = getattr(module, DISPATCH_NAME, None)
    if current is None:
        raise ValueError(f"{module.__name__} has no {DISPATCH_NAME}: its processors do not use diffusers' dispatch")
    router = current if isinstance(current, Router) else Router(current)
    setattr(module, DISPATCH_NAME, router)
    router.users += 1

    def undo() -> None:
        router.users -= 1
        if router.users == 0 and getattr(module, DISPATCH_NAME) is router:
            setattr(module, DISPATCH_NAME, router.original)

    return undo
