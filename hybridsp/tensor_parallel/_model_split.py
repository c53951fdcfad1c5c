"""Tensor parallelism for Hugging Face causal decoders over ``mesh.tensor_group``.

    mesh = hybridsp.init_mesh(ulysses=2, ring=1, tensor=2)
    tensor_parallel(model, mesh)                 # in place: each rank keeps 1/T of every layer's heads and width
    apply(model, mesh)                           # hybrid sequence-parallel attention on H/T heads per rank

Per decoder layer (rank ``t`` of ``T``; H query heads, Hkv K/V heads, D head dim, I MLP width), the parts are
found by what they are: the attention is the child with an ``o_proj``
(:mod:`hybridsp.tensor_parallel._attention_split`: q/k/v, Phi-3's fused qkv, DeepSeek-V3's MLA, sinks, q/k
norms, OLMo's norm over the projected width), the feed-forward block the child that is a gate/up/down MLP or holds 3-D experts
(:mod:`hybridsp.tensor_parallel._feed_forward_split`: dense, fused gate_up, mixture of experts):

    q_proj  [H*D, h]   -> rows of query heads   [t*H/T, (t+1)*H/T)          column-parallel
    k_proj, v_proj     -> rows of K/V heads     [t*Hkv/T, (t+1)*Hkv/T)      column-parallel
    o_proj  [h, H*D]   -> columns of the same query heads, all-reduced     row-parallel
    gate_proj, up_proj -> rows [t*I/T, (t+1)*I/T)                           column-parallel
    down_proj          -> the same columns, all-reduced                     row-parallel
    experts            -> every expert's I axis; the block output all-reduced once

Query head ``j`` uses K/V head ``j // (H/Hkv)``, so a rank's query heads use exactly its K/V
heads. Norms, embeddings and the LM head stay replicated. The attention and the feed-forward block
enter the tensor region through a forward pre-hook on the block's ``hidden_states`` (a copy, or an
all-gather with ``sequence_parallel=True``; :mod:`hybridsp.tensor_parallel._layers`), wherever the family puts
its norms (before, after, both), so parameter names stay the model's own (a checkpoint's names load unchanged,
:func:`load_sharded_safetensors`). Every check runs before anything changes; a part that cannot be split
exactly is refused in one ValueError naming it and the numbers.

Note [replicated parameters in the tensor region]: a parameter that is not split but sits between
the copy into the tensor region and the reduction (Qwen3's per-head ``q_norm`` / ``k_norm``, MLA's
``kv_a_proj_with_mqa``, a MoE router) sees only this rank's heads or width, so its gradient is a partial sum
over the tensor group; so is a row-parallel bias (``o_proj`` / ``down_proj`` with ``attention_bias`` /
``mlp_bias``) under sequence parallelism, where it is added on this rank's ``S/T`` tokens after the
reduce-scatter. Both get a gradient hook that all-reduces over the tensor group, so every tensor rank holds the
full gradient and the replicas stay equal. Without sequence parallelism a row-parallel bias is added on
all tokens, the same on every tensor rank: its gradient is already whole.

``sequence_parallel=True`` (training; Megatron-LM's "sequence parallel"): the hidden states
between the blocks hold ``1/T`` of the tokens (split before the first layer, gathered after
the final norm), the gradients of every layer parameter outside the blocks (the norms) are summed over the
tensor group (Note [sequence parallel in the tensor group] in :mod:`hybridsp.tensor_parallel._layers`).
Decoding one token at a time cannot be split, so :func:`~hybridsp.integrations.transformers._generation` wants
``sequence_parallel=False``.

The change is not undoable (the other shards are dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import nn

from hybridsp.mesh._hybrid_mesh import HybridMesh, check_tensor_heads
from hybridsp.tensor_parallel._attention_split import plan_attention
from hybridsp.tensor_parallel._cut_rule import PLAN_ATTR, TensorSplit, split_parameter, tensor_plan
from hybridsp.tensor_parallel._feed_forward_split import dense_parts, is_mixture_of_experts, plan_dense, plan_experts
from hybridsp.tensor_parallel._layers import (
    RowParallelLinear,
    copy_to_tensor,
    gather_replicated_tokens,
    gather_sequence_shards,
    split_tokens,
    sum_grad_over_tensor,
)
from hybridsp.tensor_parallel._sharded_loading import load_sharded_safetensors

__all__ = ["TensorSplit", "check_tensor_parallel", "load_sharded_safetensors", "tensor_parallel", "tensor_plan"]

COLUMN, ROW = 0, 1  # the dimension of a weight that is split


def _layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers (model.layers); tensor_parallel supports "
            f"causal decoders whose layers are model.layers"
        )
    return list(layers)


def _blocks(layer: nn.Module, where: str) -> tuple[str, nn.Module, str, nn.Module]:
    """(name, module) of the layer's attention (the child with an o_proj) and of its feed-forward block."""
    attention = [(n, c) for n, c in layer.named_children() if isinstance(getattr(c, "o_proj", None), nn.Linear)]
    forward = [(n, c) for n, c in layer.named_children() if is_mixture_of_experts(c) or dense_parts(c) is not None]
    if len(attention) != 1 or len(forward) != 1:
        raise ValueError(
            f"{where} ({type(layer).__name__}) has {len(attention)} attention blocks (a child with "
            f"o_proj) and {len(forward)} feed-forward blocks (gate/up/down_proj or 3-D experts); "
            f"tensor_parallel splits layers with one of each"
        )
    return (*attention[0], *forward[0])


def _plan_layer(layer: nn.Module, config, tensor: int, where: str) -> Callable[[str, TensorSplit, object], None]:
    """Check one decoder layer; return ``shard(prefix, plan, group)``, which splits it and installs its hooks."""
    attn_name, attention, ff_name, forward = _blocks(layer, where)
    split_attention = plan_attention(attention, config, tensor, f"{where}.{attn_name}")
    moe = is_mixture_of_experts(forward)
    # split(prefix, plan, group) for experts, split(prefix, plan) for a dense MLP
    split_forward: Callable[..., None] = (plan_experts if moe else plan_dense)(forward, tensor, f"{where}.{ff_name}")

    def shard(prefix: str, plan: TensorSplit, group) -> None:
        sp = plan.sequence_parallel
        split_attention(f"{prefix}.{attn_name}", plan, group)
        o_proj = cast(nn.Linear, attention.o_proj)  # checked by plan_attention
        attention.o_proj = _split_row(o_proj, f"{prefix}.{attn_name}.o_proj", plan, group)
        if moe:
            split_forward(f"{prefix}.{ff_name}", plan, group)
        else:
            split_forward(f"{prefix}.{ff_name}", plan)
            down_proj = cast(nn.Linear, forward.down_proj)  # checked by plan_dense
            forward.down_proj = _split_row(down_proj, f"{prefix}.{ff_name}.down_proj", plan, group)
        for name, block in ((attn_name, attention), (ff_name, forward)):
            plan.handles.append(block.register_forward_pre_hook(_enter_hook(group, sp), with_kwargs=True))
            partial = _partial_grad_params(block, f"{prefix}.{name}", plan)
            plan.handles += [sum_grad_over_tensor(p, group) for p in partial]
        if sp:  # the norms, wherever they are, see S/T tokens
            outside = [p for n, p in layer.named_parameters() if n.split(".")[0] not in (attn_name, ff_name)]
            plan.handles += [sum_grad_over_tensor(p, group) for p in outside if p.requires_grad]

    return shard


def check_tensor_parallel(model: nn.Module, mesh: HybridMesh) -> list[Callable]:
    """Raise ValueError, before anything changes, when the model cannot be split ``mesh.tensor`` ways; returns
    the per-layer split functions (:func:`tensor_parallel` runs them)."""
    config: Any = model.config  # a transformers config (a dynamic nn.Module attribute)
    tensor = mesh.tensor
    if getattr(model, PLAN_ATTR, None) is not None:
        raise ValueError(f"{type(model).__name__} is already tensor-parallel; call tensor_parallel once")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    check_tensor_heads(heads, kv, tensor, mesh.ulysses)
    return [_plan_layer(layer, config, tensor, f"layer {index}") for index, layer in enumerate(_layers(model))]


def _split_row(linear: nn.Linear, name: str, plan: TensorSplit, group) -> RowParallelLinear:
    """A :class:`RowParallelLinear` holding input columns ``[rank/T, (rank+1)/T)`` of ``linear``."""
    split_parameter(linear, "weight", f"{name}.weight", plan, 1)  # [out, in/T]
    weight = cast(nn.Parameter, linear.weight)  # split_parameter set a new nn.Parameter
    return RowParallelLinear(weight, linear.bias, group, plan.sequence_parallel)


def _enter_hook(group, sequence_parallel: bool):
    """Forward pre-hook: the block's ``hidden_states`` (first positional or keyword) enter the tensor region."""
    enter = gather_sequence_shards if sequence_parallel else copy_to_tensor

    def hook(module, args, kwargs):
        if args:
            return (enter(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"], group)}

    return hook


def _partial_grad_params(block: nn.Module, prefix: str, plan: TensorSplit) -> list[nn.Parameter]:
    """The replicated parameters of a block whose gradient each tensor rank only holds a part of (Note
    [replicated parameters in the tensor region]): every unsplit one, but a row-parallel bias without SP."""
    whole = (
        set()
        if plan.sequence_parallel
        else {id(m.bias) for m in block.modules() if isinstance(m, RowParallelLinear) and m.bias is not None}
    )
    return [
        p
        for n, p in block.named_parameters()
        if p.requires_grad and f"{prefix}.{n}" not in plan.split_dims and id(p) not in whole
    ]


def _split_first_layer_input(group, tensor: int):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]  # [B, S/C, h], the same shape on every tensor rank
        if hidden.shape[1] % tensor:
            raise ValueError(
                f"sequence parallelism in the tensor group splits this rank's {hidden.shape[1]} tokens {tensor} ways; "
                f"pad the sequence so that tokens per context rank are a multiple of tensor={tensor}, or build the "
                f"model with sequence_parallel=False (decoding one token at a time needs False)"
            )
        if args:
            return (split_tokens(args[0], group), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": split_tokens(kwargs["hidden_states"], group)}

    return hook


def _gather_after(group):
    def hook(module, args, output):
        return gather_replicated_tokens(output, group)

    return hook


def _sequence_parallel_ends(model: nn.Module, plan: TensorSplit, group) -> None:
    """Split the hidden states [B, S, h] -> [B, S/T, h] before layer 0; gather them after the final norm."""
    base = getattr(model, "model", model)
    plan.handles.append(
        _layers(model)[0].register_forward_pre_hook(_split_first_layer_input(group, plan.tensor), with_kwargs=True)
    )
    norm = cast(nn.Module, base.norm)  # the final norm of a transformers decoder
    plan.handles.append(norm.register_forward_hook(_gather_after(group)))
    plan.handles += [sum_grad_over_tensor(p, group) for p in norm.parameters() if p.requires_grad]


def tensor_parallel(model: nn.Module, mesh: HybridMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model``'s attention and MLP linears over ``mesh.tensor_group`` in place; returns ``model``.

    Args:
        model: a transformers causal decoder (``LlamaForCausalLM``, ``Qwen3MoeForCausalLM``, ``Phi3ForCausalLM``,
            ``DeepseekV3ForCausalLM``, ...; the parts it knows: module docstring),
            on a real device or on ``meta`` (then the shards are meta too: load them with
            :func:`load_sharded_safetensors`, which never builds the whole model).
        mesh: a mesh with ``mesh.tensor`` = T; T = 1 returns the model unchanged.
        sequence_parallel: keep 1/T of the tokens outside the linears (training; module docstring).

    Raises:
        ValueError, before changing anything, when heads, K/V heads (T x U) or an MLP or expert width do
        not divide, or a part has no exact split; the message names the part and the numbers.
    """
    if mesh.tensor == 1:
        return model
    shards = check_tensor_parallel(model, mesh)
    plan = TensorSplit(mesh.tensor, mesh.tensor_rank, sequence_parallel)
    base_prefix = "model." if hasattr(model, "model") else ""
    for index, shard in enumerate(shards):
        shard(f"{base_prefix}layers.{index}", plan, mesh.tensor_group)
    if sequence_parallel:
        _sequence_parallel_ends(model, plan, mesh.tensor_group)
    setattr(model, PLAN_ATTR, plan)
    return model
