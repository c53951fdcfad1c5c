"""Load a Hugging Face safetensors checkpoint straight into a tensor-parallel model's shards.

The model is built on ``meta`` and split by :func:`~hybridsp.tensor_parallel._model_split.tensor_parallel`; each
tensor is read through ``safe_open(...).get_slice``, so a rank reads only its rows, columns or expert axis
(every fused block's part, :func:`hybridsp.tensor_parallel._cut_rule.take_shard`). Replicated tensors are read whole.

Checkpoints keep mixture-of-experts weights per expert (``experts.{e}.gate_proj.weight [I, h]``, ``up_proj``,
``down_proj [h, I]``: how transformers saves Qwen3-MoE and DeepSeek-V3 and how their hub checkpoints are) while
the model holds them fused in 3-D (``experts.gate_up_proj``, ``experts.down_proj``): a fused tensor missing from
the checkpoint is assembled from the per-expert slices of this rank, in the experts module's own layout
(concatenated or interleaved gate/up, transposed or not). Other per-expert names (Mixtral's original
``block_sparse_moe.experts.{e}.w1``) are reported missing.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from hybridsp.tensor_parallel._cut_rule import TensorSplit, tensor_plan

FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def load_sharded_safetensors(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Load a checkpoint directory's ``*.safetensors`` straight into this rank's shards.

    ``model`` is a tensor-parallel model built on the ``meta`` device (nothing allocated), or an unsplit one
    (then every tensor is read whole). Non-persistent buffers (RoPE frequencies) are rebuilt by constructing
    the rotary module again on ``device``.

    Raises:
        ValueError naming the tensors the checkpoint lacks.
    """
    from safetensors import safe_open

    plan = tensor_plan(model)
    wanted = list(model.state_dict().keys())
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(os.path.join(directory, path), framework="pt", device="cpu"))
            for path in sorted(os.listdir(directory))
            if path.endswith(".safetensors")
        ]
        index = {name: handle for handle in handles for name in handle.keys()}
        state = {}
        for name in wanted:
            if name in index:
                state[name] = _read_shard(index[name].get_slice(name), name, plan)
            elif name.endswith(FUSED_EXPERTS) and _has_expert_parts(index, name):
                state[name] = _fused_from_experts(model, index, name, plan)
    missing = set(wanted) - set(state)
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in missing:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"the checkpoint in {directory} lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    state = {name: value.to(device=device, dtype=dtype) for name, value in state.items()}
    model.load_state_dict(state, assign=True, strict=True)
    _rebuild_rotary(model, device)
    return model


def _range(size: int, plan: TensorSplit | None) -> slice:
    """This rank's ``1/T`` of ``size`` (all of it unsplit)."""
    if plan is None:
        return slice(0, size)
    step = size // plan.tensor
    return slice(plan.rank * step, (plan.rank + 1) * step)


def _read_shard(piece, name: str, plan: TensorSplit | None) -> torch.Tensor:
    """This rank's part of a safetensors slice (all of it when ``name`` is not split): the rows (or columns,
    or expert axis) of every fused block along the split dim."""
    if plan is None or name not in plan.split_dims:
        return piece[:]
    dim, size = plan.split_dims[name], piece.get_shape()[plan.split_dims[name]]
    parts, start = [], 0
    for block in plan.split_blocks.get(name, (size,)):
        part = _range(block, plan)
        parts.append(piece[(slice(None),) * dim + (slice(start + part.start, start + part.stop),)])
        start += block
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _expert_key(name: str, expert: int, projection: str) -> str:
    return f"{name.rsplit('.', 1)[0]}.{expert}.{projection}.weight"


def _has_expert_parts(index: dict, name: str) -> bool:
    projections = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
    return all(_expert_key(name, 0, p) in index for p in projections)


def _fused_from_experts(model: nn.Module, index: dict, name: str, plan: TensorSplit | None) -> torch.Tensor:
    """The fused ``gate_up_proj`` [E, 2I/T, h] (or [E, h, 2I/T]) or ``down_proj`` [E, h, I/T] (or [E, I/T, h]) of
    this rank, stacked from the checkpoint's per-expert ``gate_proj``/``up_proj`` [I, h] and ``down_proj`` [h, I]."""
    experts = model.get_submodule(name.rsplit(".", 1)[0])
    transposed = getattr(experts, "is_transposed", False)
    count = getattr(experts, name.rsplit(".", 1)[1]).shape[0]  # E
    stacked = []
    for expert in range(count):
        if name.endswith("down_proj"):
            piece = index[_expert_key(name, expert, "down_proj")].get_slice(_expert_key(name, expert, "down_proj"))
            local = piece[:, _range(piece.get_shape()[1], plan)]  # [h, I/T]
        else:
            gate, up = (
                index[_expert_key(name, expert, p)].get_slice(_expert_key(name, expert, p))
                for p in ("gate_proj", "up_proj")
            )
            rows = _range(gate.get_shape()[0], plan)
            gate, up = gate[rows], up[rows]  # [I/T, h] each
            if getattr(experts, "is_concatenated", True):
                local = torch.cat([gate, up], dim=0)  # [2I/T, h]: g | u
            else:
                local = torch.stack([gate, up], dim=1).flatten(0, 1)  # [2I/T, h]: g0 u0 g1 u1 ...
        stacked.append(local.t() if transposed else local)
    return torch.stack(stacked)  # [E, ...]


def _rebuild_rotary(model: nn.Module, device) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                with torch.device(device):
                    setattr(module, name, type(child)(config=child.config))
