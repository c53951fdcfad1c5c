"""Tiled MLP: run each decoder layer's gated MLP over sequence tiles, recomputing in backward.

A Llama-family MLP ``down(act(gate(x)) * up(x))`` makes three ``[T, I]`` intermediates per
layer (I ~ 3.5 h) and autograd keeps them for backward: at long context, per token, more than
attention's own activations. :func:`apply_tiled_mlp` switches every such MLP of a model to

    forward   (no autograd) one tile of ``tile_tokens`` rows at a time into the [T, h] output;
              keeps only the input x [B, S_local, h]
    backward  per tile: recompute the tile with autograd, take the gradients of its rows of x
              and of the weights (summed over tiles in fp32), free the tile

so at most one tile's intermediates exist at a time. Gradients are exact (the same math per
row; weight gradients are sums over rows in any order).

Note [ZeRO-3]: the MLP's weights are gathered once per layer per pass (once in forward, once in
backward: :func:`hybridsp.memory._sharded_params.gathered`, i.e. ``deepspeed.zero.GatheredParameters``),
never per tile, and the autograd function returns each weight's gradient once, summed over the
tiles, so DeepSpeed's gradient hook (reduce-scatter) fires once per weight per backward. The
number of tiles therefore never reaches a collective: ranks with different local lengths
cannot deadlock (DeepSpeed's own TiledMLP gathers per tile and must agree on the tile count).
The linear submodules are not called as modules (their DeepSpeed hooks would gather and
release around every tile); the weights are used functionally (``F.linear``).

Note [input from its norm]: when the MLP's input is a lean norm's output
(:mod:`hybridsp.memory._lean_norm`, Note [norm source]: Llama's ``post_attention_layernorm`` under
``apply_lean_norms``), the function keeps the norm's input and ``rstd``, which the norm's own backward
keeps anyway, instead of its input, and rebuilds each tile's input rows in backward with the norm's own
ops: bit-identical rows, one [B, S_local, h] activation fewer per layer. The norm's weight is gathered
with the MLP's for the backward. Not under DeepSpeed ZeRO-3 as it stands: its module hooks hand each
module's output on as ``output.detach()`` (a new tensor without the norm's source), so the MLP keeps
its input as before (found by ``benchmarks.memory.step_peak``; matching by storage would reach it).

Note [compiled tiles]: ``torch.compile`` cannot trace this backward (``torch.autograd.grad`` per
tile). While dynamo traces, each tile runs under non-reentrant activation checkpointing instead: the
same memory contract (x kept, one tile's intermediates recomputed at a time in backward), the weight
gradients summed by autograd in their own dtype (fp32 sums in eager), no ZeRO-3 gather (ZeRO-3 with
compile is DeepSpeed's own compiler's).

Note [activation checkpointing]: under HF gradient checkpointing the decoder layer's forward
runs again in backward; this MLP's forward then runs again too (one more gather, no saved
intermediates), and its backward recomputes per tile as without checkpointing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridsp.memory._forward_patch import ForwardPatch, patch_forwards
from hybridsp.memory._lean_norm import norm_source, normalize
from hybridsp.memory._sharded_params import gathered

_PARTS = ("gate_proj", "up_proj", "down_proj")


def tiled_mlp_forward(mlp: nn.Module, x: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """``mlp(x)`` computed ``tile_tokens`` rows at a time (differentiable in x and the weights).

    Args:
        mlp: a gated MLP with ``gate_proj``, ``up_proj``, ``down_proj`` (``nn.Linear``) and ``act_fn``.
        x: [..., h] (e.g. [B, S_local, h]).
        tile_tokens: rows (tokens, over the flattened leading dimensions) per tile.

    Returns:
        [..., h] in x's dtype.
    """
    params, biased = _params_of(mlp)
    if torch.compiler.is_compiling():
        if any(hasattr(p, "ds_id") for p in params):
            raise ValueError(
                "the tiled MLP under torch.compile cannot gather ZeRO-3 partitioned weights: compile "
                "with ZeRO stage 0-2, or leave the MLP untiled (handle.undo())"
            )
        # act_fn: a dynamic attribute of the MLP (a callable: find_gated_mlps checked it)
        return _checkpointed_tiles(x, mlp.act_fn, tile_tokens, biased, params)  # type: ignore[arg-type]
    source = norm_source(x) if torch.is_grad_enabled() else None  # Note [input from its norm]
    with gathered(params):
        return cast(torch.Tensor, _TiledMLP.apply(x, mlp.act_fn, tile_tokens, biased, source, *params))


def _checkpointed_tiles(
    x: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    tile: int,
    biased: tuple[bool, ...],
    params: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The tiled MLP as a graph can hold it (Note [compiled tiles]): each tile under non-reentrant
    activation checkpointing, so only x is kept and every tile is recomputed in backward."""
    flat = x.reshape(-1, x.shape[-1])  # [T, h]
    tiles = [
        checkpoint(_mlp_math, flat[start : start + tile], act, params, biased, use_reentrant=False)
        for start in range(0, flat.shape[0], tile)
    ]  # each [t, h]
    out = torch.cat(tiles) if tiles else _mlp_math(flat, act, params, biased)  # [T, h]; T = 0: empty
    return out.reshape(*x.shape[:-1], out.shape[-1])  # [..., h]


def _params_of(mlp: nn.Module) -> tuple[list[torch.Tensor], tuple[bool, ...]]:
    """([gate.w, up.w, down.w] + the biases that exist, in that order; which of the three have a bias).

    Any subset of the projections may carry a bias (e.g. only ``down_proj``); each is used."""
    linears = [getattr(mlp, name) for name in _PARTS]
    biased = tuple(linear.bias is not None for linear in linears)
    biases = [linear.bias for linear in linears if linear.bias is not None]
    return [linear.weight for linear in linears] + biases, biased


def _mlp_math(
    x: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    params: Sequence[torch.Tensor],
    biased: tuple[bool, ...],
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with explicit weights; x [t, h] -> [t, h]. ``biased``: which of
    gate/up/down have a bias (those follow the three weights in ``params``, in that order)."""
    extra = iter(params[3:])
    gate_b, up_b, down_b = (next(extra) if has else None for has in biased)
    gate_w, up_w, down_w = params[:3]
    return F.linear(act(F.linear(x, gate_w, gate_b)) * F.linear(x, up_w, up_b), down_w, down_b)


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
        tile: int,
        biased: tuple[bool, ...],
        source: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [T, h]
        out = torch.empty(flat.shape[0], params[2].shape[0], dtype=x.dtype, device=x.device)  # [T, h]
        for start in range(0, flat.shape[0], tile):
            out[start : start + tile] = _mlp_math(flat[start : start + tile], act, params, biased)
        if source is None:
            ctx.save_for_backward(x)
            ctx.norm_weight = None
        else:  # the norm's input and rstd, which the norm keeps too: x itself is rebuilt per tile
            ctx.save_for_backward(source[0], source[2])
            ctx.norm_weight = source[1]
        ctx.act, ctx.tile, ctx.biased, ctx.params, ctx.x_shape = act, tile, biased, params, x.shape
        return out.reshape(*x.shape[:-1], out.shape[-1])  # [..., h]

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows_of = _input_rows(ctx.saved_tensors, ctx.norm_weight)
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])  # [T, h]
        wanted = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[5 + i]]
        norm = [] if ctx.norm_weight is None else [ctx.norm_weight]
        with gathered([*ctx.params, *norm]):
            leaves = [p.detach().requires_grad_(i in wanted) for i, p in enumerate(ctx.params)]
            sums = {
                i: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                for i, p in enumerate(leaves)
                if i in wanted
            }
            grad_x = (
                grad_flat.new_empty(grad_flat.shape[0], ctx.x_shape[-1]) if ctx.needs_input_grad[0] else None
            )  # [T, h]
            for start in range(0, grad_flat.shape[0], ctx.tile):
                rows = slice(start, start + ctx.tile)
                tile_x = rows_of(rows).detach().requires_grad_(grad_x is not None)
                with torch.enable_grad():
                    tile_out = _mlp_math(tile_x, ctx.act, leaves, ctx.biased)
                inputs = ([tile_x] if grad_x is not None else []) + [leaves[i] for i in wanted]
                grads = torch.autograd.grad(tile_out, inputs, grad_flat[rows])
                if grad_x is not None:
                    grad_x[rows] = grads[0]
                    grads = grads[1:]
                for i, grad in zip(wanted, grads):
                    sums[i] += grad
            grad_params = [sums[i].to(p.dtype) if i in sums else None for i, p in enumerate(leaves)]
        grad_x = None if grad_x is None else grad_x.reshape(ctx.x_shape)
        return (grad_x, None, None, None, None, *grad_params)


def _input_rows(saved: tuple[torch.Tensor, ...], norm_weight: torch.Tensor | None) -> Callable[[slice], torch.Tensor]:
    """rows -> the MLP input's rows [t, h]: a view of the kept input, or rebuilt from the norm's kept input
    and rstd (Note [input from its norm])."""
    if norm_weight is None:
        (x,) = saved
        flat = x.reshape(-1, x.shape[-1])  # [T, h]
        return lambda rows: flat[rows]
    source, rstd = saved
    source_flat, rstd_flat = source.reshape(-1, source.shape[-1]), rstd.reshape(-1, 1)  # [T, h], [T, 1]
    return lambda rows: normalize(source_flat[rows], norm_weight, rstd_flat[rows])


TiledMLPHandle = ForwardPatch  # what apply_tiled_mlp returns: ``undo()`` restores every MLP


def find_gated_mlps(model: nn.Module) -> list[nn.Module]:
    """Every module with ``gate_proj``/``up_proj``/``down_proj`` linears and an ``act_fn``."""
    return [
        m
        for m in model.modules()
        if all(isinstance(getattr(m, name, None), nn.Linear) for name in _PARTS)
        and callable(getattr(m, "act_fn", None))
    ]


def apply_tiled_mlp(model: nn.Module, *, tile_tokens: int | None = None) -> TiledMLPHandle:
    """Run every gated MLP of ``model`` tiled over the sequence (module docstring); returns the undo handle.

    Args:
        model: a module holding Llama-family MLPs (``LlamaMLP``, ``MistralMLP``, ``Qwen2MLP``, ...).
        tile_tokens: tokens per tile; default the model's hidden size (one tile's intermediates
            then take ``3 x h x I`` elements).

    Raises:
        ValueError when the model has no gated MLP, one is already tiled, or ``tile_tokens < 1``.
    """
    modules = find_gated_mlps(model)
    # down_proj.out_features: dynamic attributes of an nn.Linear (find_gated_mlps checked it)
    tile = (
        modules[0].down_proj.out_features  # type: ignore[union-attr]
        if modules and tile_tokens is None
        else tile_tokens
    )
    # tile is None only without any MLP, which patch_forwards rejects before it makes a forward
    return patch_forwards(
        modules,
        lambda module: _bound_forward(module, tile),  # type: ignore[arg-type]
        tile,  # type: ignore[arg-type]
        model=model,
        what="gated MLP (gate_proj/up_proj/down_proj + act_fn) to tile",
    )


def _bound_forward(module: nn.Module, tile: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp_forward(module, x, tile)

    return forward
