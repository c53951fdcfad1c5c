"""The tensor axis in :func:`hybridsp.integrations.deepspeed.initialize`: split the model, check the optimizer, answer the mpu.

Note [tensor parallel]: with ``T > 1`` (the ``"hybridsp"`` section's ``"tensor"``, or DeepSpeed's
own ``"tensor_parallel": {"autotp_size": T}``; they must agree, and ``initialize(tensor=)`` wins)
the model's attention and MLP linears are split over ``mesh.tensor_group`` by
:func:`hybridsp.tensor_parallel.model_split.tensor_parallel` before DeepSpeed sees it, and the
``tensor_parallel`` key is removed: DeepSpeed's AutoTP would replace the mpu with its own groups
(engine ``_configure_tensor_parallel_states``: ``self.mpu = groups``), which know nothing of the
context ranks. ZeRO then partitions and reduces over the ``DP x C`` ranks of one tensor rank
(``mesh.data_context_group``), never across the tensor group; the mpu also answers
``get_data_parallel_group`` with that group, so that ZeRO-3's parameter partitioning (which
otherwise takes the world group) stays inside it. Gradient clipping is refused with ``T > 1``:
DeepSpeed's norm would sum each tensor rank's own shards only (the reported norm is not the
model's). An optimizer instance built on the whole weights is refused too (it would hold the
replaced parameters): pass a callable ``optimizer=lambda params: ...`` or a config optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridsp.mesh.hybrid_mesh import HybridMesh
from hybridsp.tensor_parallel.model_split import tensor_parallel

SECTION = "hybridsp"


def autotp_size(config: dict, section: dict) -> dict:
    """``{"tensor": T}`` from DeepSpeed's ``"tensor_parallel": {"autotp_size": T}`` (empty when absent);
    ValueError when it disagrees with the section's ``"tensor"``."""
    block = config.get("tensor_parallel")
    size = block.get("autotp_size", block.get("tp_size")) if isinstance(block, dict) else None
    if size is None:
        return {}
    if "tensor" in section and section["tensor"] != size:
        raise ValueError(
            f"tensor_parallel.autotp_size={size} disagrees with the {SECTION} section's tensor={section['tensor']}; "
            f"set one of them (or make them equal)"
        )
    return {"tensor": size}


def check_tensor_config(config: dict, tensor: int) -> None:
    """ValueError for gradient clipping with ``tensor > 1`` (DeepSpeed 0.19's default clipping is 1.0)."""
    clipping = config.get("gradient_clipping", 1.0)
    if tensor > 1 and clipping:
        raise ValueError(
            f"gradient_clipping={clipping}{'' if 'gradient_clipping' in config else ' (DeepSpeed default)'} with "
            f"tensor={tensor}: DeepSpeed's gradient norm would count only each tensor rank's own shards "
            f"(Note [tensor parallel] in hybridsp.integrations.deepspeed.tensor); set \"gradient_clipping\": 0 "
            f"or tensor 1"
        )


def check_tensor_optimizer(optimizer: Any, tensor: int) -> None:
    """ValueError for an optimizer instance with ``tensor > 1`` (it holds the unsplit weights)."""
    if tensor > 1 and isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"tensor={tensor} replaces the model's linear weights by their shards, so an optimizer built on the "
            f"whole weights would update nothing; pass optimizer=lambda params: YourOptimizer(params, ...) (DeepSpeed "
            f"calls it with the sharded parameters) or an \"optimizer\" section in the config"
        )


def split_tensors(model: nn.Module, mesh: HybridMesh, sequence_parallel: bool) -> None:
    """Split the model's linears over the tensor group when ``T > 1`` (not undoable)."""
    if mesh.tensor > 1:
        tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)


def tensor_mpu_getattr(mpu: Any, name: str):
    """``HybridMPU.__getattr__``: ``get_data_parallel_group`` (the DP x C group of this tensor rank)
    exists only with ``T > 1``; with ``T = 1`` DeepSpeed must not find it (Note [the mpu])."""
    if name == "get_data_parallel_group" and mpu.__dict__["mesh"].tensor > 1:
        return mpu.get_sequence_data_parallel_group
    raise AttributeError(name)
