"""The tensor axis in :func:`hybridsp.integrations.deepspeed.initialize`: split the model, check the optimizer, answer the mpu.

Note [tensor parallel]: with ``T > 1`` (the ``"hybridsp"`` section's ``"tensor"``, or DeepSpeed's
own ``"tensor_parallel": {"autotp_size": T}``; they must agree, and ``initialize(tensor=)`` wins)
the model's attention and MLP linears are split over ``mesh.tensor_group`` by
:func:`hybridsp.tensor_parallel._model_split.tensor_parallel` before DeepSpeed sees it, and the
``tensor_parallel`` key is removed: DeepSpeed's AutoTP would replace the mpu with its own groups
(engine ``_configure_tensor_parallel_states``: ``self.mpu = groups``), which know nothing of the
context ranks. ZeRO then partitions and reduces over the ``DP x C`` ranks of one tensor rank
(``mesh.data_context_group``), never across the tensor group; the mpu also answers
``get_data_parallel_group`` with that group, so that ZeRO-3's parameter partitioning (which
otherwise takes the world group) stays inside it. An optimizer instance built on the whole
weights is refused (it would hold the replaced parameters): pass a callable
``optimizer=lambda params: ...`` or a config optimizer.

Note [tensor-parallel gradient norm]: DeepSpeed's norm (the one it clips with and reports as
``engine.get_global_grad_norm()``) sums squares over its partition group (``DP x C`` here),
then over the model-parallel group, where a parameter counts on every rank when
:func:`deepspeed.runtime.utils.is_model_parallel_parameter` says so and else only on
model-parallel rank 0. That is exact for the tensor axis when (1) every split parameter carries
``tensor_model_parallel = True`` (:func:`mark_split_parameters`) and (2) the model-parallel
group, rank and size are the tensor group's: split shards are then summed over the ``T``
ranks, replicated parameters (norms, embeddings, the LM head; their gradients are whole and
equal on every tensor rank) are counted once, and context and DP ranks, which hold equal
reduced gradients, are not counted again (ZeRO's partitions of them are disjoint; stage 0
sums over the tensor group only). (2) is what :class:`~hybridsp.integrations.deepspeed._engine.HybridMPU`
answers with ``T > 1`` (stage 0: ``clip_grad_norm_``; bf16/fp16 optimizers). ZeRO 1, 2 and 3
ignore those answers for a sequence-parallel mpu (``model_parallel_group = None`` when the mpu has
``initialize_sequence_parallel``), so :func:`count_tensor_shards_in_norm` sets the three
attributes on the built ZeRO optimizer (the one place hybridsp writes into DeepSpeed's
objects for the norm; undone by ``initialize``'s ``undo``). Overflow checks (a MAX over the same
group) then also agree across the tensor group. ``get_slice_parallel_rank`` is deliberately
absent: DeepSpeed's ``bwc_tensor_model_parallel_rank`` would prefer it over
``get_model_parallel_rank`` and must name a rank of the model-parallel group it sums over.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hybridsp.mesh._hybrid_mesh import HybridMesh
from hybridsp.tensor_parallel._model_split import tensor_parallel, tensor_plan

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


def check_tensor_optimizer(optimizer: Any, tensor: int) -> None:
    """ValueError for an optimizer instance with ``tensor > 1`` (it holds the unsplit weights)."""
    if tensor > 1 and isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"tensor={tensor} replaces the model's linear weights by their shards, so an optimizer built on the "
            f"whole weights would update nothing; pass optimizer=lambda params: YourOptimizer(params, ...) (DeepSpeed "
            f'calls it with the sharded parameters) or an "optimizer" section in the config'
        )


def split_tensors(model: nn.Module, mesh: HybridMesh, sequence_parallel: bool) -> None:
    """Split the model's linears over the tensor group when ``T > 1`` and mark the shards for
    DeepSpeed's norm (:func:`mark_split_parameters`); not undoable."""
    if mesh.tensor > 1:
        tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        mark_split_parameters(model)


def mark_split_parameters(model: nn.Module) -> list[str]:
    """Set ``tensor_model_parallel = True`` (the attribute DeepSpeed's and Megatron's norms read)
    on every parameter :func:`tensor_parallel` split; returns their names
    (Note [tensor-parallel gradient norm])."""
    plan = tensor_plan(model)
    assert plan is not None  # split_tensors calls it right after tensor_parallel
    split = plan.split_dims
    marked = []
    for name, param in model.named_parameters():
        if name in split:
            param.tensor_model_parallel = True  # type: ignore[attr-defined]  # read by DeepSpeed's norm
            marked.append(name)
    if len(marked) != len(split):
        missing = sorted(set(split) - set(marked))
        raise ValueError(
            f"{len(missing)} split parameters are not parameters of the model (e.g. {missing[0]}); "
            f"mark_split_parameters needs the model tensor_parallel returned"
        )
    return marked


def model_parallel_group(mesh: HybridMesh):
    """The group DeepSpeed sums norms over: the tensor group with ``T > 1`` (Note [tensor-parallel
    gradient norm]), else the context group (Note [the mpu])."""
    return mesh.tensor_group if mesh.tensor > 1 else mesh.context_group


def model_parallel_rank(mesh: HybridMesh) -> int:
    """This rank's index in :func:`model_parallel_group` (its rank 0 counts replicated gradients)."""
    return mesh.tensor_rank if mesh.tensor > 1 else dist.get_rank(mesh.context_group)


def model_parallel_world_size(mesh: HybridMesh) -> int:
    """The size of :func:`model_parallel_group`."""
    return mesh.tensor if mesh.tensor > 1 else mesh.context


def _zero_norm_ignores_the_mpu(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of DeepSpeed's ZeRO optimizers that compute the gradient norm
    themselves without the mpu's model-parallel answers: not ``None`` or ZeRO-3's optimizer-less
    parameter offload (no norm), not the bf16 optimizer (it sums over the mpu's model-parallel group)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))


def count_tensor_shards_in_norm(optimizer: Any, mesh: HybridMesh, stage: int) -> Callable[[], None]:
    """Make a ZeRO 1/2/3 optimizer's gradient norm sum over the tensor group; returns the undo.

    DeepSpeed's ZeRO optimizers drop the mpu's model-parallel answers for a sequence-parallel
    mpu; this sets their ``model_parallel_group`` / ``_rank`` (/ ``_world_size`` on ZeRO 1/2)
    to the tensor group's (Note [tensor-parallel gradient norm]). A no-op with ``T = 1``, at
    stage 0 and for optimizers that ask the mpu or compute no norm (:func:`_zero_norm_ignores_the_mpu`).
    RuntimeError when a ZeRO optimizer lacks the attributes
    (a DeepSpeed that computes its norm differently: the norm would be wrong, not just slow).
    """
    if mesh.tensor == 1 or stage == 0 or not _zero_norm_ignores_the_mpu(optimizer):
        return _no_undo
    if not hasattr(optimizer, "model_parallel_group") or not hasattr(optimizer, "model_parallel_rank"):
        raise RuntimeError(
            f"{type(optimizer).__name__} (ZeRO stage {stage}) has no model_parallel_group / "
            f"model_parallel_rank: this DeepSpeed computes the gradient norm differently, and with "
            f"tensor={mesh.tensor} it would miss the other tensor ranks' shards"
        )
    values = {
        "model_parallel_group": mesh.tensor_group,
        "model_parallel_rank": mesh.tensor_rank,
        "model_parallel_world_size": mesh.tensor,
    }
    before = {name: getattr(optimizer, name) for name in values if hasattr(optimizer, name)}
    for name in before:
        setattr(optimizer, name, values[name])

    def undo() -> None:
        for name, value in before.items():
            setattr(optimizer, name, value)

    return undo


def _no_undo() -> None:
    """The undo of a change that was not made."""


def tensor_mpu_getattr(mpu: Any, name: str):
    """``HybridMPU.__getattr__``: ``get_data_parallel_group`` (the DP x C group of this tensor rank)
    exists only with ``T > 1``; with ``T = 1`` DeepSpeed must not find it (Note [the mpu])."""
    if name == "get_data_parallel_group" and mpu.__dict__["mesh"].tensor > 1:
        return mpu.get_sequence_data_parallel_group
    raise AttributeError(name)
