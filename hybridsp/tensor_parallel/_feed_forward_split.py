"""Split one Hugging Face feed-forward block over the tensor group by its intermediate width, recognised by
what it holds.

A dense MLP (``down_proj`` plus ``gate_proj``/``up_proj`` or a fused ``gate_up_proj``) keeps rows
``[t*I/T, (t+1)*I/T)`` of its gate and up projections (each half of a fused ``gate_up_proj``, the layout
``chunk(2)`` reads, separately) and the same columns of ``down_proj``, a
:class:`~hybridsp.tensor_parallel._layers.RowParallelLinear` that reduces over the tensor group.

A mixture-of-experts block (a child ``experts`` holding 3-D ``gate_up_proj`` / ``down_proj``, as transformers
5 keeps them fused) splits every expert the same way: the ``2I`` axis of ``gate_up_proj`` (``[E, 2I, h]``, or
``[E, h, 2I]`` when ``is_transposed``; a concatenated layout is cut per half, an interleaved one ``g0 u0 g1 u1
...`` is one contiguous range per rank) with its bias, the ``I`` axis of ``down_proj``. The gating is
element-wise over ``I`` (SwiGLU, GPT-OSS's clamped variant), so each rank's expert outputs are partial sums of
the whole block's output, still multiplied by the (replicated) routing weights; the block's output is reduced
once, by a forward hook (all-reduce, or reduce-scatter over tokens with sequence parallelism). Shared experts
(DeepSeek-V3, Qwen2-MoE) are dense MLPs inside the block: their ``down_proj`` keeps its columns as a plain linear
and joins that one reduction. An expert down bias ``[E, h]`` is added per expert before the reduction, so only
tensor rank 0 adds it (Note [a bias added once inside the reduction]). The router stays replicated: it sits
inside the tensor region, so its gradient is a partial sum (Note [replicated parameters in the tensor region] in
:mod:`hybridsp.tensor_parallel._model_split`).

Note [a bias added once inside the reduction]: every rank's experts add ``down_proj_bias[e]`` to each expert's
output before it is weighted and summed, so the reduced block output would hold it ``T`` times. On tensor ranks
other than 0 a forward hook on the experts subtracts what their forward added, ``sum_k w[n, k] *
bias[index[n, k]]`` (from the call's own ``(hidden, top_k_index, top_k_weights)``), so the reduction adds it once;
the parameter stays whole and equal on every rank (registered before any engine's hooks, the hook runs before
ZeRO-3's post-forward release; not tested under ZeRO-3), its gradient there is ``g - g = 0`` (rank 0's is whole),
and the tensor-group sum of the gradient hook makes it whole everywhere. The routing weights' gradient is then
each rank's partial sum, as for every replicated parameter of the region.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from hybridsp.tensor_parallel._cut_rule import TensorSplit, split_parameter
from hybridsp.tensor_parallel._layers import reduce_from_tensor, scatter_tokens

SHARED_MODULES = ("gate", "router", "shared_expert_gate")  # replicated inside a mixture-of-experts block


def is_mixture_of_experts(block: nn.Module) -> bool:
    down = getattr(getattr(block, "experts", None), "down_proj", None)
    return isinstance(down, nn.Parameter) and down.dim() == 3


def dense_parts(mlp: nn.Module) -> tuple[dict[str, tuple[int, ...] | None], int] | None:
    """({column linear: fused blocks or None}, width I) of a dense MLP, or None when ``mlp`` is not one."""
    down = getattr(mlp, "down_proj", None)
    if not isinstance(down, nn.Linear):
        return None
    width = down.in_features
    gate_up = getattr(mlp, "gate_up_proj", None)
    if isinstance(gate_up, nn.Linear) and gate_up.out_features == 2 * width:
        return {"gate_up_proj": (width, width)}, width
    names = [n for n in ("gate_proj", "up_proj") if isinstance(getattr(mlp, n, None), nn.Linear)]
    if "up_proj" not in names or any(getattr(mlp, n).out_features != width for n in names):
        return None
    return dict.fromkeys(names), width


def _check_width(width: int, tensor: int, what: str) -> None:
    if width % tensor:
        raise ValueError(
            f"{what} {width} is not divisible by tensor={tensor}; choose a tensor degree that divides {width}"
        )


def plan_dense(mlp: nn.Module, tensor: int, where: str) -> Callable[[str, TensorSplit], None]:
    """Check a dense MLP and return ``split(prefix, plan)``, which splits its column linears; ``down_proj`` is
    left to the caller (row-parallel)."""
    parts = dense_parts(mlp)
    if parts is None:
        raise ValueError(
            f"{where} ({type(mlp).__name__}) is neither a gate/up/down_proj MLP nor a mixture of "
            f"experts with 3-D experts: tensor_parallel does not know how to split it"
        )
    columns, width = parts
    _check_width(width, tensor, f"{where}'s intermediate width (down_proj in_features)")
    _refuse_unknown(mlp, (*columns, "down_proj"), where)

    def split(prefix: str, plan: TensorSplit) -> None:
        for name, blocks in columns.items():
            linear = getattr(mlp, name)
            split_parameter(linear, "weight", f"{prefix}.{name}.weight", plan, 0, blocks)  # [out/T, h]
            if linear.bias is not None:
                split_parameter(linear, "bias", f"{prefix}.{name}.bias", plan, 0, blocks)
            linear.out_features //= plan.tensor

    return split


def _refuse_unknown(module: nn.Module, known: tuple[str, ...], where: str) -> None:
    for name, param in module.named_parameters():
        if name.split(".")[0] not in known:
            raise ValueError(
                f"{where}.{name} {tuple(param.shape)} has no known tensor-parallel split "
                f"(tensor_parallel knows {', '.join(known)})"
            )


def _expert_axes(experts: nn.Module) -> tuple[int, int, int]:
    """(width I, the 2I axis of gate_up_proj, the I axis of down_proj)."""
    transposed = getattr(experts, "is_transposed", False)
    down_axis = 1 if transposed else 2  # [E, I, h] or [E, h, I]
    down = cast(torch.Tensor, experts.down_proj)  # a 3-D parameter (is_mixture_of_experts)
    return down.shape[down_axis], 2 if transposed else 1, down_axis


def plan_experts(block: nn.Module, tensor: int, where: str) -> Callable[[str, TensorSplit, object], None]:
    """Check a mixture-of-experts block and return ``split(prefix, plan, group)``: experts and shared experts
    split, the output reduction and the once-only down bias hooked."""
    experts = cast(nn.Module, block.experts)  # a module holding 3-D parameters (is_mixture_of_experts)
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(
            f"{where}.experts normalises each expert's output, which a split of the intermediate "
            f"width cannot reproduce (tensor_parallel refuses; run with tensor=1)"
        )
    width, gate_up_axis, down_axis = _expert_axes(experts)
    _check_width(width, tensor, f"{where}.experts' intermediate width")
    gated = getattr(experts, "has_gate", True)
    up_rows = cast(torch.Tensor, experts.gate_up_proj).shape[gate_up_axis]
    if up_rows != (2 * width if gated else width):
        raise ValueError(
            f"{where}.experts.gate_up_proj has {up_rows} rows along its projection axis for "
            f"an intermediate width {width}: its layout is not known"
        )
    blocks = (width, width) if gated and getattr(experts, "is_concatenated", True) else None  # interleaved: one
    shared = {
        n: plan_dense(child, tensor, f"{where}.{n}")
        for n, child in block.named_children()
        if n != "experts" and n not in SHARED_MODULES and dense_parts(child) is not None
    }
    known = ("experts", *shared, *SHARED_MODULES)
    _refuse_unknown(block, known, where)
    _refuse_unknown(experts, ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), f"{where}.experts")

    def split(prefix: str, plan: TensorSplit, group) -> None:
        names = {
            "gate_up_proj": (gate_up_axis, blocks),
            "gate_up_proj_bias": (1, blocks),
            "down_proj": (down_axis, None),
        }
        for attr, (axis, cut) in names.items():
            if isinstance(getattr(experts, attr, None), nn.Parameter):
                split_parameter(experts, attr, f"{prefix}.experts.{attr}", plan, axis, cut)
        for attr in ("intermediate_dim", "intermediate_size"):
            if isinstance(getattr(experts, attr, None), int):
                setattr(experts, attr, getattr(experts, attr) // plan.tensor)
        for name, split_columns in shared.items():
            split_columns(f"{prefix}.{name}", plan)
            child = getattr(block, name)
            split_parameter(child.down_proj, "weight", f"{prefix}.{name}.down_proj.weight", plan, 1)  # [h, I/T]
            child.down_proj.in_features //= plan.tensor
        if isinstance(getattr(experts, "down_proj_bias", None), nn.Parameter):
            plan.handles += _bias_once(experts, plan.rank)
        plan.handles.append(block.register_forward_hook(_reduce_output(group, plan.sequence_parallel)))

    for name in shared:
        if getattr(getattr(block, name).down_proj, "bias", None) is not None:
            raise ValueError(
                f"{where}.{name}.down_proj has a bias, added inside the experts' reduction: "
                f"tensor_parallel does not split it"
            )
    return split


def _bias_once(experts: nn.Module, rank: int) -> list:
    """Note [a bias added once inside the reduction]: nothing on rank 0, the added bias subtracted elsewhere."""
    if rank == 0:
        return []

    def subtract(module, args, output):
        if len(args) < 3:
            raise ValueError(
                f"{type(module).__name__} was called without positional (hidden, top_k_index, "
                f"top_k_weights); tensor_parallel needs them to add its down_proj_bias once"
            )
        index, weights = args[1], args[2]  # [N, k] each
        valid = index < module.down_proj_bias.shape[0]  # [N, k] (a masking index adds nothing)
        added = module.down_proj_bias[index.clamp(max=module.down_proj_bias.shape[0] - 1)]  # [N, k, h]
        added = (added * (weights * valid)[..., None]).sum(dim=1)  # [N, h]
        return output - added.to(output.dtype)

    return [experts.register_forward_hook(subtract)]


def _reduce_output(group, sequence_parallel: bool):
    """Forward hook: sum the block's partial output [B, S, h] over the tensor group (its first element when the
    block returns a tuple, e.g. GPT-OSS's (hidden, router scores))."""

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = scatter_tokens(hidden, group) if sequence_parallel else reduce_from_tensor(hidden, group)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return hook
