"""Split one Hugging Face attention module over the tensor group by heads, recognised by its projections.

Rank ``t`` of ``T`` keeps query heads ``[t*H/T, (t+1)*H/T)`` and K/V heads ``[t*Hkv/T, (t+1)*Hkv/T)``
(projection rows are head-major, so a head range is a row range):

    q_proj, k_proj, v_proj   rows of its heads (and bias)                       column-parallel
    qkv_proj (Phi-3)         the blocks [H*D | Hkv*D | Hkv*D] each cut by heads   column-parallel
    q_proj / q_b_proj, kv_b_proj (DeepSeek-V3 MLA)   rows of its heads          column-parallel
    q_a_proj, kv_a_proj_with_mqa, their norms (MLA)  replicated (shared by all heads)
    q_norm, k_norm over the head dim (Qwen3, Gemma 3)  replicated (the same weight for every head)
    q_norm, k_norm over the projected width (OLMo 2/3)  weights of its heads, the sum of squares all-reduced
                             (:mod:`hybridsp.tensor_parallel._width_norm`; refused unless a plain RMS norm)
    sinks [H] (GPT-OSS)      entries of its query heads
    o_proj                   columns of its query heads, all-reduced              row-parallel

A parameter of another kind is refused: its split is unknown. Module attributes holding head counts
(``num_heads``, ``num_key_value_heads``) are set to the rank's counts; Phi-3's forward reads the query head count
from ``self.config``, so its attention modules get their own copy of the config with ``H/T`` heads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import cast

from torch import nn

from hybridsp.tensor_parallel._cut_rule import TensorSplit, split_parameter
from hybridsp.tensor_parallel._width_norm import WidthShardedRMSNorm, is_plain_rms_norm

STANDARD = ("q_proj", "k_proj", "v_proj")
MLA_SPLIT = ("q_proj", "q_b_proj", "kv_b_proj")  # by heads
MLA_SHARED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
HEAD_NORMS = ("q_norm", "k_norm")


def _head_dim(attention: nn.Module, config) -> int:
    return (
        getattr(attention, "head_dim", None)
        or getattr(config, "head_dim", None)
        or (config.hidden_size // config.num_attention_heads)
    )


def plan_attention(attention: nn.Module, config, tensor: int, where: str) -> Callable[[str, TensorSplit, object], None]:
    """Check that ``attention`` can be split ``tensor`` ways (ValueError naming the part and the numbers) and
    return the function that splits it: ``split(prefix, plan, group)``; ``o_proj`` is left to the caller
    (row-parallel)."""
    if not isinstance(getattr(attention, "o_proj", None), nn.Linear):
        raise ValueError(
            f"{where} ({type(attention).__name__}) has no o_proj linear: tensor_parallel splits "
            f"attention whose output projection is o_proj"
        )
    if hasattr(attention, "kv_b_proj"):
        column, shared = _mla_parts(attention, where)
    elif hasattr(attention, "qkv_proj"):
        column, shared = {"qkv_proj": _fused_qkv_blocks(attention, config)}, ()
    else:
        missing = [n for n in STANDARD if not isinstance(getattr(attention, n, None), nn.Linear)]
        if missing:
            raise ValueError(
                f"{where} ({type(attention).__name__}) has no {', '.join(missing)}: tensor_parallel "
                f"knows q/k/v_proj, a fused qkv_proj and MLA's q(_b)_proj/kv_b_proj"
            )
        column, shared = dict.fromkeys(STANDARD), ()
    per_head, over_width = _check_head_norms(attention, config, where)
    _refuse_unknown(attention, (*column, "o_proj", "sinks", *shared, *per_head, *over_width), where)

    def split(prefix: str, plan: TensorSplit, group) -> None:
        for name, blocks in column.items():
            _split_linear_rows(getattr(attention, name), f"{prefix}.{name}", plan, blocks)
        for name in over_width:
            norm = getattr(attention, name)
            split_parameter(norm, "weight", f"{prefix}.{name}.weight", plan, 0)  # [W/T]
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
            assert isinstance(eps, float)  # is_plain_rms_norm accepted this norm only with a float eps
            setattr(attention, name, WidthShardedRMSNorm(norm.weight, eps, norm.weight.numel() * plan.tensor, group))
        if isinstance(getattr(attention, "sinks", None), nn.Parameter):
            split_parameter(attention, "sinks", f"{prefix}.sinks", plan, 0)  # [H/T]
        _local_head_counts(attention, config, plan.tensor, "qkv_proj" in column)

    return split


def _mla_parts(attention: nn.Module, where: str) -> tuple[dict, tuple[str, ...]]:
    query = "q_b_proj" if isinstance(getattr(attention, "q_b_proj", None), nn.Linear) else "q_proj"
    if not isinstance(getattr(attention, query, None), nn.Linear):
        raise ValueError(f"{where} ({type(attention).__name__}) has kv_b_proj but no q_proj or q_b_proj linear")
    shared = tuple(n for n in MLA_SHARED if isinstance(getattr(attention, n, None), nn.Module))
    return {query: None, "kv_b_proj": None}, shared


def _fused_qkv_blocks(attention: nn.Module, config) -> tuple[int, int, int]:
    dim = _head_dim(attention, config)
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    blocks = (config.num_attention_heads * dim, kv * dim, kv * dim)
    rows = cast(nn.Linear, attention.qkv_proj).out_features
    if sum(blocks) != rows:
        raise ValueError(
            f"qkv_proj has {rows} rows, not H*D + 2*Hkv*D = {' + '.join(map(str, blocks))}: its layout is not q | k | v"
        )
    return blocks


def _check_head_norms(attention: nn.Module, config, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the q/k norms over one head's dim: replicated, those over the projected width: split by heads); a norm
    over another width, or over the projected width but not a plain RMS norm, is refused."""
    dim, per_head, over_width = _head_dim(attention, config), [], []
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for name, heads in zip(HEAD_NORMS, (config.num_attention_heads, kv)):
        norm = getattr(attention, name, None)
        weight = getattr(norm, "weight", None)
        if norm is None:
            continue
        if weight is None or weight.numel() == dim:
            per_head.append(name)
        elif weight.numel() == heads * dim and is_plain_rms_norm(norm):
            over_width.append(name)
        else:
            raise ValueError(
                f"{where}.{name} ({type(norm).__name__}) normalises over {weight.numel()} features, neither one head's "
                f"{dim} nor a plain RMS norm over the {heads} x {dim} projected width: a split over heads would change "
                f"it (tensor_parallel refuses; run this family with tensor=1)"
            )
    return tuple(per_head), tuple(over_width)


def _refuse_unknown(attention: nn.Module, known: tuple[str, ...], where: str) -> None:
    for name, param in attention.named_parameters():
        if name.split(".")[0] not in known:
            raise ValueError(
                f"{where}.{name} {tuple(param.shape)} has no known tensor-parallel split "
                f"(tensor_parallel knows {', '.join(known)})"
            )


def _split_linear_rows(linear: nn.Linear, name: str, plan: TensorSplit, blocks: tuple[int, ...] | None) -> None:
    """Keep this rank's output rows of ``linear`` (weight [out/T, in], bias [out/T]) in place."""
    split_parameter(linear, "weight", f"{name}.weight", plan, 0, blocks)
    if linear.bias is not None:
        split_parameter(linear, "bias", f"{name}.bias", plan, 0, blocks)
    linear.out_features //= plan.tensor


def _local_head_counts(attention: nn.Module, config, tensor: int, fused: bool) -> None:
    for attr in ("num_heads", "num_key_value_heads", "num_attention_heads"):
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, getattr(attention, attr) // tensor)
    if fused:  # Phi-3 slices qkv at self.config.num_attention_heads * head_dim
        local = copy.copy(config)
        local.num_attention_heads = config.num_attention_heads // tensor
        attention.config = local
