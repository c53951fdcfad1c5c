"""Lean RMSNorm: Llama's RMSNorm with its backward keeping the input and one scale per row only.

Hugging Face's ``LlamaRMSNorm`` (and the families that copy it) computes

    out = weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)        x: [..., h]

as four autograd ops, and autograd keeps, besides the input x, the normalized rows
``x * rsqrt(...)`` ([..., h] in fp32) for the weight's multiply: one activation of the hidden size
per norm, two per decoder layer, and the backward's temporaries (pow, mul, div chains) add several
more at the peak. Under activation checkpointing the peak of a step is one layer's recompute plus
its backward, and these copies are a large share of it.

:func:`apply_lean_norms` switches every such norm of a model to one autograd function that

    forward   the same ops in the same order (bit-identical output), keeps x and ``rstd`` [..., 1]
    backward  per tile of ``tile_tokens`` rows: rebuilds the normalized rows and returns
              dx = rstd * (g - xhat * mean(g * xhat)),  g = grad * weight  (fp32)
              dweight = sum over rows of grad * xhat.to(x.dtype)  (summed in fp32)

so the norm adds no [..., h] activation of its own and its backward's temporaries are one tile's.
Gradients equal autograd's up to fp32 rounding (the same formula, another association).

Note [which norms]: only classes whose forward is exactly the formula above are switched
(:data:`LLAMA_STYLE_NORMS`, by class name; each is checked against its own forward by
tests/memory/test_lean_norm.py). Gemma's ``(1 + weight)`` norm, LayerNorm, and norms with other
casts are left alone.

Note [ZeRO-3]: the weight is read only inside the module's own call (forward, and the backward of
its output), where DeepSpeed's module hooks have gathered it, exactly as for the original forward;
the function returns the weight's gradient once, so DeepSpeed's gradient hook fires once.

Note [norm source]: the output tensor carries how it was made (:class:`NormSource`: weak references to
x and ``rstd``, the weight). A consumer that keeps its input for backward only to recompute from it
(the tiled MLP after ``post_attention_layernorm``) can keep x and ``rstd`` instead, which this norm
keeps anyway, and rebuild its input rows with :func:`normalize` (the same ops, so bit-identical rows):
one [..., h] activation fewer per norm. The output's version is recorded: an output modified in
place since is not rebuilt from its source (:func:`norm_source` says None).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, cast

import torch
from torch import nn

from hybridsp.memory._forward_patch import ForwardPatch, patch_forwards

LLAMA_STYLE_NORMS = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
        "Phi3RMSNorm",
    }
)
DEFAULT_TILE_TOKENS = 1024
SOURCE_ATTR = "_hybridsp_norm_source"  # the attribute a lean norm's output carries (Note [norm source])


def normalize(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The norm's output rows from its input x [..., h] and their ``rstd`` [..., 1]: [..., h]. The forward's
    own ops, so rows recomputed from saved x and rstd equal the forward's bit for bit (Note [norm source])."""
    return weight * (x.to(torch.float32) * rstd).to(x.dtype)


@dataclass(frozen=True)
class NormSource:
    """How a lean norm's output was made: ``normalize(x, weight, rstd)``; x and rstd held weakly (the
    norm's autograd node keeps them while its graph lives). ``version``: the output's version then."""

    x: weakref.ref[torch.Tensor]
    weight: torch.Tensor
    rstd: weakref.ref[torch.Tensor]
    version: int


def norm_source(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(x, weight, rstd) when ``out`` is a lean norm's output, unmodified since, whose input and rstd are
    alive; else None (Note [norm source])."""
    source = getattr(out, SOURCE_ATTR, None)
    if not isinstance(source, NormSource) or out._version != source.version:
        return None
    x, rstd = source.x(), source.rstd()
    return None if x is None or rstd is None else (x, source.weight, rstd)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, tile: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rstd = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        out = normalize(x, weight, rstd)  # [..., h]
        ctx.save_for_backward(x, weight, rstd)
        ctx.mark_non_differentiable(rstd)
        ctx.tile = tile
        return out, rstd

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, _grad_rstd: None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        width = x.shape[-1]
        rows, grads, scales = x.reshape(-1, width), grad_out.reshape(-1, width), rstd.reshape(-1, 1)  # [T, h], [T, 1]
        grad_x = torch.empty_like(rows) if ctx.needs_input_grad[0] else None  # [T, h]
        grad_w = torch.zeros(width, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        for start in range(0, rows.shape[0], ctx.tile):
            tile = slice(start, start + ctx.tile)
            _tile_backward(rows[tile], grads[tile], scales[tile], weight, grad_x, grad_w, tile)
        grad_x = None if grad_x is None else grad_x.reshape(x.shape)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None


def _tile_backward(
    x: torch.Tensor,
    grad: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    grad_x: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    rows: slice,
) -> None:
    """One tile's share: writes ``grad_x[rows]`` and adds into ``grad_w`` (x, grad: [t, h]; rstd [t, 1])."""
    xhat = x.to(torch.float32) * rstd  # [t, h]
    if grad_w is not None:
        grad_w += (grad * xhat.to(x.dtype)).to(torch.float32).sum(0)
    if grad_x is not None:
        g = (grad * weight).to(torch.float32)  # [t, h]
        grad_x[rows] = (rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)


def lean_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, tile_tokens: int = DEFAULT_TILE_TOKENS
) -> torch.Tensor:
    """Llama's RMSNorm of ``x`` [..., h] with ``weight`` [h] (module docstring); [..., h].

    The output carries its :class:`NormSource` (Note [norm source])."""
    out, rstd = cast("tuple[torch.Tensor, torch.Tensor]", _LeanRMSNorm.apply(x, weight, eps, tile_tokens))
    setattr(out, SOURCE_ATTR, NormSource(weakref.ref(x), weight, weakref.ref(rstd), out._version))
    return out


LeanNormHandle = ForwardPatch  # what apply_lean_norms returns: ``undo()`` restores every norm


def find_llama_style_norms(model: nn.Module) -> list[nn.Module]:
    """Every module of a class in :data:`LLAMA_STYLE_NORMS` with a ``weight`` and ``variance_epsilon``."""
    return [
        m
        for m in model.modules()
        if type(m).__name__ in LLAMA_STYLE_NORMS
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and hasattr(m, "variance_epsilon")
    ]


def apply_lean_norms(model: nn.Module, *, tile_tokens: int = DEFAULT_TILE_TOKENS) -> LeanNormHandle:
    """Switch every Llama-style RMSNorm of ``model`` to :func:`lean_rms_norm`; returns the undo handle.

    Raises:
        ValueError when the model has no such norm (names in :data:`LLAMA_STYLE_NORMS`), one is
        already switched, or ``tile_tokens < 1``.
    """
    return patch_forwards(
        find_llama_style_norms(model),
        lambda module: _bound_forward(module, tile_tokens),
        tile_tokens,
        model=model,
        what=f"Llama-style RMSNorm (one of {sorted(LLAMA_STYLE_NORMS)})",
    )


def _bound_forward(module: nn.Module, tile: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        # weight, variance_epsilon: dynamic attributes of the norm (find_llama_style_norms checked them)
        return lean_rms_norm(hidden_states, module.weight, module.variance_epsilon, tile)  # type: ignore[arg-type]

    return forward
