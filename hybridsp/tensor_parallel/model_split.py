"""Tensor parallelism for Hugging Face Llama-family causal LMs over ``mesh.tensor_group``.

    mesh = hybridsp.init_mesh(ulysses=2, ring=1, tensor=2)
    tensor_parallel(model, mesh)                 # in place: each rank keeps 1/T of every layer's linears
    apply(model, mesh)                           # hybrid sequence-parallel attention on H/T heads per rank

Per decoder layer (rank ``t`` of ``T``; H query heads, Hkv K/V heads, D head dim, I MLP width):

    q_proj  [H*D, h]   -> rows of query heads   [t*H/T, (t+1)*H/T)          column-parallel
    k_proj, v_proj     -> rows of K/V heads     [t*Hkv/T, (t+1)*Hkv/T)      column-parallel
    o_proj  [h, H*D]   -> columns of the same query heads, all-reduced     row-parallel
    gate_proj, up_proj -> rows [t*I/T, (t+1)*I/T)                           column-parallel
    down_proj          -> the same columns, all-reduced                     row-parallel

Query head ``j`` uses K/V head ``j // (H/Hkv)``, so a rank's query heads use exactly its K/V
heads. Norms, embeddings and the LM head stay replicated. The layer norms in front of the
attention and the MLP enter the tensor region through a forward hook on the norm (a copy, or
an all-gather with ``sequence_parallel=True``; :mod:`hybridsp.tensor_parallel.layers`), so parameter names stay
the model's own (a checkpoint's names load unchanged, :func:`load_sharded_safetensors`).

Note [replicated parameters in the tensor region]: a parameter that is not split but sits between
the copy into the tensor region and the row-parallel reduction (Qwen3's per-head ``q_norm`` /
``k_norm``) sees only this rank's heads, so its gradient is a partial sum over the tensor group;
so is a row-parallel bias (``o_proj`` / ``down_proj`` with ``attention_bias`` / ``mlp_bias``) under
sequence parallelism, where it is added on this rank's ``S/T`` tokens after the reduce-scatter.
Both get a gradient hook that all-reduces over the tensor group, so every tensor rank holds the
full gradient and the replicas stay equal. Without sequence parallelism a row bias is added on
all tokens, the same on every tensor rank: its gradient is already whole.

``sequence_parallel=True`` (training; Megatron-LM's "sequence parallel"): the hidden states
between the linears hold ``1/T`` of the tokens (split before the first layer, gathered after
the final norm), norm gradients are summed over the tensor group
(Note [sequence parallel in the tensor group] in :mod:`hybridsp.tensor_parallel.layers`). Decoding one
token at a time cannot be split, so :func:`~hybridsp.integrations.transformers.generation` wants
``sequence_parallel=False``.

The change is not undoable (the other shards are dropped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridsp.mesh.hybrid_mesh import HybridMesh, check_tensor_heads
from hybridsp.tensor_parallel.layers import (
    RowParallelLinear,
    copy_to_tensor,
    gather_replicated_tokens,
    gather_sequence_shards,
    shard_rows,
    split_tokens,
    sum_grad_over_tensor,
)

_ATTR = "_hybridsp_tensor"
COLUMN, ROW = 0, 1  # the dimension of a weight that is split


@dataclass
class TensorPlan:
    """What :func:`tensor_parallel` did to one model: which parameter is split along which dim."""

    tensor: int
    rank: int
    sequence_parallel: bool
    split_dims: dict[str, int] = field(default_factory=dict)  # parameter name -> split dim
    handles: list = field(default_factory=list)


def _layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers (model.layers); tensor_parallel supports "
                         f"Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3)")
    return list(layers)


def check_tensor_parallel(model: nn.Module, mesh: HybridMesh) -> None:
    """Raise ValueError, before anything changes, when the model cannot be split ``mesh.tensor`` ways."""
    config, tensor = model.config, mesh.tensor
    if getattr(model, _ATTR, None) is not None:
        raise ValueError(f"{type(model).__name__} is already tensor-parallel; call tensor_parallel once")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    check_tensor_heads(heads, kv, tensor, mesh.ulysses)
    width = config.intermediate_size
    if width % tensor:
        raise ValueError(f"the MLP width intermediate_size={width} is not divisible by tensor={tensor}; "
                         f"choose a tensor degree that divides {width}")
    for index, layer in enumerate(_layers(model)):
        missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(layer.self_attn, n)]
        missing += [n for n in ("gate_proj", "up_proj", "down_proj") if not hasattr(layer.mlp, n)]
        if missing:
            raise ValueError(f"layer {index} has no {', '.join(missing)}: tensor_parallel supports Llama-family "
                             f"layers (q/k/v/o_proj, gate/up/down_proj)")


def _split_column(linear: nn.Linear, tensor: int, rank: int) -> None:
    """Keep output rows ``[rank/T, (rank+1)/T)`` of ``linear`` (weight and bias) in place."""
    with torch.no_grad():
        linear.weight = nn.Parameter(shard_rows(linear.weight, tensor, rank).clone(),
                                     requires_grad=linear.weight.requires_grad)  # [out/T, in]
        if linear.bias is not None:
            linear.bias = nn.Parameter(shard_rows(linear.bias, tensor, rank).clone(),
                                       requires_grad=linear.bias.requires_grad)  # [out/T]
    linear.out_features //= tensor


def _split_row(linear: nn.Linear, tensor: int, rank: int, group, sequence_parallel: bool) -> RowParallelLinear:
    """A :class:`RowParallelLinear` holding input columns ``[rank/T, (rank+1)/T)`` of ``linear``."""
    with torch.no_grad():
        weight = linear.weight.chunk(tensor, dim=1)[rank].clone()  # [out, in/T]
    return RowParallelLinear(nn.Parameter(weight, requires_grad=linear.weight.requires_grad), linear.bias, group,
                             sequence_parallel)


def _enter_hook(group, sequence_parallel: bool):
    def hook(module, args, output):
        return gather_sequence_shards(output, group) if sequence_parallel else copy_to_tensor(output, group)

    return hook


def _shard_layer(layer: nn.Module, prefix: str, plan: TensorPlan, group) -> None:
    tensor, rank, sp = plan.tensor, plan.rank, plan.sequence_parallel
    attention, mlp = layer.self_attn, layer.mlp
    for parent, names, row in ((attention, ("q_proj", "k_proj", "v_proj"), "o_proj"),
                               (mlp, ("gate_proj", "up_proj"), "down_proj")):
        part = "self_attn" if parent is attention else "mlp"
        for name in names:
            _split_column(getattr(parent, name), tensor, rank)
            plan.split_dims[f"{prefix}.{part}.{name}.weight"] = 0
            if getattr(parent, name).bias is not None:
                plan.split_dims[f"{prefix}.{part}.{name}.bias"] = 0
        setattr(parent, row, _split_row(getattr(parent, row), tensor, rank, group, sp))
        plan.split_dims[f"{prefix}.{part}.{row}.weight"] = 1
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        plan.handles.append(norm.register_forward_hook(_enter_hook(group, sp)))
        if sp:
            plan.handles += [sum_grad_over_tensor(p, group) for p in norm.parameters() if p.requires_grad]
    plan.handles += [sum_grad_over_tensor(p, group) for p in _partial_grad_params(layer, prefix, plan)]


def _partial_grad_params(layer: nn.Module, prefix: str, plan: TensorPlan) -> list[nn.Parameter]:
    """The replicated parameters of ``layer``'s attention and MLP whose gradient each tensor rank only
    holds a part of (Note [replicated parameters in the tensor region])."""
    partial = []
    for part in ("self_attn", "mlp"):
        for name, param in getattr(layer, part).named_parameters():
            full_name = f"{prefix}.{part}.{name}"
            if full_name in plan.split_dims or not param.requires_grad:
                continue
            row_bias = name in ("o_proj.bias", "down_proj.bias")
            if plan.sequence_parallel or not row_bias:
                partial.append(param)
    return partial


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


def _sequence_parallel_ends(model: nn.Module, plan: TensorPlan, group) -> None:
    """Split the hidden states [B, S, h] -> [B, S/T, h] before layer 0; gather them after the final norm."""
    base = getattr(model, "model", model)
    plan.handles.append(_layers(model)[0].register_forward_pre_hook(_split_first_layer_input(group, plan.tensor),
                                                                with_kwargs=True))
    plan.handles.append(base.norm.register_forward_hook(_gather_after(group)))
    plan.handles += [sum_grad_over_tensor(p, group) for p in base.norm.parameters() if p.requires_grad]


def tensor_parallel(model: nn.Module, mesh: HybridMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model``'s attention and MLP linears over ``mesh.tensor_group`` in place; returns ``model``.

    Args:
        model: a Llama-family transformers model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...),
            on a real device or on ``meta`` (then the shards are meta too: load them with
            :func:`load_sharded_safetensors`, which never builds the whole model).
        mesh: a mesh with ``mesh.tensor`` = T; T = 1 returns the model unchanged.
        sequence_parallel: keep 1/T of the tokens outside the linears (training; module docstring).

    Raises:
        ValueError, before changing anything, when heads, K/V heads (T x U) or the MLP width do
        not divide; the message names the numbers.
    """
    if mesh.tensor == 1:
        return model
    check_tensor_parallel(model, mesh)
    plan = TensorPlan(mesh.tensor, mesh.tensor_rank, sequence_parallel)
    base_prefix = "model." if hasattr(model, "model") else ""
    for index, layer in enumerate(_layers(model)):
        _shard_layer(layer, f"{base_prefix}layers.{index}", plan, mesh.tensor_group)
    if sequence_parallel:
        _sequence_parallel_ends(model, plan, mesh.tensor_group)
    setattr(model, _ATTR, plan)
    return model


def tensor_plan(model: nn.Module) -> TensorPlan | None:
    """The :class:`TensorPlan` of a model :func:`tensor_parallel` changed, else None."""
    return getattr(model, _ATTR, None)


def load_sharded_safetensors(model: nn.Module, directory: str | os.PathLike, *, dtype: torch.dtype | None = None,
                             device: str | torch.device = "cpu") -> nn.Module:
    """Load a checkpoint directory's ``*.safetensors`` straight into this rank's shards.

    ``model`` is a tensor-parallel model built on the ``meta`` device (nothing allocated):
    each tensor is read through ``safe_open(...).get_slice`` so only this rank's rows (or
    columns) are read; replicated tensors are read whole. Non-persistent buffers (RoPE
    frequencies) are rebuilt by constructing the rotary module again on ``device``.
    """
    from safetensors import safe_open

    plan = tensor_plan(model)
    split = {} if plan is None else plan.split_dims
    state = {}
    wanted = set(model.state_dict().keys())
    for path in sorted(os.listdir(directory)):
        if not path.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(directory, path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if name not in wanted:
                    continue
                piece = handle.get_slice(name)
                state[name] = _read_shard(piece, split.get(name), plan).to(device=device, dtype=dtype)
    missing = wanted - set(state)
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in missing:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"the checkpoint in {directory} lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    model.load_state_dict(state, assign=True, strict=True)
    _rebuild_rotary(model, device)
    return model


def _read_shard(piece, dim: int | None, plan: TensorPlan | None) -> torch.Tensor:
    """This rank's slice along ``dim`` of a safetensors slice (all of it when ``dim`` is None)."""
    if dim is None:
        return piece[:]
    size = piece.get_shape()[dim]
    step = size // plan.tensor
    lo, hi = plan.rank * step, (plan.rank + 1) * step
    return piece[lo:hi] if dim == 0 else piece[:, lo:hi]


def _rebuild_rotary(model: nn.Module, device) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                with torch.device(device):
                    setattr(module, name, type(child)(config=child.config))
