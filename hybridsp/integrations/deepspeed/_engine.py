"""DeepSpeed ZeRO (stages 0-3) composed with hybrid sequence parallelism, set up from the JSON config.

The engine side of :func:`hybridsp.integrations.deepspeed.initialize` (usage: the package face): the
mpu, the mesh, the engine's ``initialize`` (which takes the caller's attention switch) and the
gradient scale.

The ``"hybridsp"`` config section, its checks and DeepSpeed's config clean-up (Note [keys we
own], Note [auto precision]) live in :mod:`hybridsp.integrations.deepspeed._config`.

Note [the mpu]: DeepSpeed asks a "model parallel unit" for its groups. :class:`HybridMPU`
answers from the mesh: the *sequence-parallel* group is ``mesh.context_group`` and the
*sequence-data-parallel* group is ``mesh.data_context_group`` (all DP x C ranks). DeepSpeed
(utils/groups.py, engine.py) then partitions ZeRO states and reduces gradients over DP x C,
and divides reduced gradients by ``DP x C / C = DP``. The method name
``initialize_sequence_parallel`` is DeepSpeed's marker for such an mpu: with it, DeepSpeed
treats the model-parallel size as 1 and takes no pure data-parallel group from us. We
deliberately define no ``get_data_parallel_group``: ZeRO-3 would partition parameters over
it, and a group without the context ranks partitions wrongly. ``get_data_parallel_world_size``
/ ``_rank`` are the replica count and index (DeepSpeed's batch arithmetic and its data
sampler want those). With ``T = 1`` the model-parallel getters alias the context group (as
DeepSpeed's own ``parallel_state_sp`` does): stage 0 clips by summing gradient norms over that
group with only its rank 0 counting, which counts each replicated gradient once. With ``T > 1``
they answer the tensor group (Note [tensor-parallel gradient norm] in
:mod:`hybridsp.integrations.deepspeed._tensor`).

Note [gradient scale]: each rank's loss is its share of its replica's loss
(:func:`hybridsp.sharded_cross_entropy`: value = replica loss, gradient = this rank's tokens'
part), so the exact gradient is the *sum* over the context ranks, averaged over the DP
replicas: ``sum over DP x C / DP``. ZeRO 0-2 reduce that way. ZeRO-3's reduce-scatter divides
by the size of the partition group, ``DP x C``, ignoring ``sequence_parallel_size``
(stage3.py ``__avg_scatter_grads``): gradients come out ``1/C`` too small, which Adam hides
but the gradient norm, clipping and SGD do not. Its ``reduce_scatter: false`` path divides by
``DP`` only for parameters that fit the reduce bucket and by ``DP x C`` for larger ones (a
real model's embedding), so it is refused. :func:`initialize` registers one tensor hook per
parameter on ZeRO-3 that multiplies the incoming gradient by ``C`` (exact for power-of-two
``C``), so ``engine.backward(loss)`` is right at every stage; the norm DeepSpeed reports
and clips is the unsharded model's.

Note [timeouts]: when a rank dies, its peers' next collective with it fails at once on gloo
(the connection resets), but a peer blocked in a collective of a group without the dead rank
waits for the process group's timeout (torch's default: 30 minutes). Launchers (``deepspeed``,
``torchrun``) kill the remaining ranks when one exits non-zero, which bounds that; without one,
pass :func:`init_distributed` a timeout. On NCCL, torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
(on by default since torch 2.2) turns a timed-out collective into an abort of the process.

DeepSpeed traps worth knowing (0.19.8): the engine keeps the last mpu in a module global
(``deepspeed.utils.groups.mpu``) that a later engine built *without* an mpu inherits;
``engine.set_train_batch_size`` fails with any sequence-parallel mpu (DeepSpeed's
data-parallel size is None then); on CPU, DeepSpeed's communication init JIT-compiles
``deepspeed_shm_comm`` once (about two minutes, cached in ``~/.cache/torch_extensions``),
which the gloo backend does not use.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from hybridsp._types import BackendName
from hybridsp.integrations.deepspeed._compiling import compile_settings
from hybridsp.integrations.deepspeed._config import HybridConfig, deepspeed_config, load_config
from hybridsp.integrations.deepspeed._tensor import (
    check_tensor_optimizer,
    count_tensor_shards_in_norm,
    model_parallel_group,
    model_parallel_rank,
    model_parallel_world_size,
    split_tensors,
    tensor_mpu_getattr,
)
from hybridsp.mesh._hybrid_mesh import HybridMesh, init_mesh


def build_mesh(hybrid: HybridConfig) -> HybridMesh:
    """The mesh over the initialised world (a collective); sizes are checked before any communication."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialised (deepspeed.init_distributed() does it)")
    shape = hybrid.mesh_shape(dist.get_world_size())
    return init_mesh(
        shape.ulysses,
        shape.ring,
        order=shape.order,
        layout=shape.layout,
        kv_comm=shape.kv_comm,
        kv_chunks=shape.kv_chunks,
        tensor=shape.tensor,
        head_chunks=shape.head_chunks,
    )


class HybridMPU:
    """DeepSpeed's model-parallel unit for a :class:`HybridMesh` (Note [the mpu]). Groups are the mesh's."""

    def __init__(self, mesh: HybridMesh):
        self.mesh = mesh

    def initialize_sequence_parallel(self) -> None:
        """DeepSpeed's marker for a sequence-parallel mpu; the mesh is already built, so this does nothing."""

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.context_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.context

    def get_sequence_parallel_rank(self) -> int:
        return dist.get_rank(self.mesh.context_group)

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.mesh.data_context_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.world_size

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.mesh.data_context_group)

    def get_data_parallel_world_size(self) -> int:
        """Replicas (DP): DeepSpeed's batch size is micro batch x accumulation x this."""
        return self.mesh.dp

    def get_data_parallel_rank(self) -> int:
        return self.mesh.dp_rank

    def get_slice_parallel_world_size(self) -> int:
        """Tensor-parallel degree T: DeepSpeed records it in checkpoints and its universal-checkpoint
        converter and loader read it (the model-parallel getters below would say C)."""
        return self.mesh.tensor

    __getattr__ = tensor_mpu_getattr  # get_data_parallel_group only with T > 1 (deepspeed_tensor)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        """The group DeepSpeed sums gradient norms over: the context group with ``T = 1`` (Note [the mpu]),
        the tensor group with ``T > 1`` (Note [tensor-parallel gradient norm] in ``deepspeed.tensor``)."""
        return model_parallel_group(self.mesh)

    def get_model_parallel_world_size(self) -> int:
        return model_parallel_world_size(self.mesh)

    def get_model_parallel_rank(self) -> int:
        return model_parallel_rank(self.mesh)

    def __repr__(self) -> str:
        return f"HybridMPU({self.mesh!r})"


def _times(grad: torch.Tensor, factor: float) -> torch.Tensor:
    return grad * factor


def scale_gradients(model: nn.Module, factor: float) -> Callable[[], None]:
    """Multiply every parameter's incoming gradient by ``factor`` (tensor hooks); returns their remover."""
    hook = functools.partial(_times, factor=float(factor))
    handles = [p.register_hook(hook) for p in model.parameters() if p.requires_grad]

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


AttentionSwitch = Callable[[nn.Module, HybridMesh, BackendName], Callable[[], None]]
"""``switch(model, mesh, backend) -> undo``: what :func:`initialize` calls to put a model's attention on the mesh."""


def _no_undo() -> None:
    """The undo of a switch that did nothing."""


class HybridEngine(NamedTuple):
    """What :func:`initialize` returns; ``undo()`` removes the gradient hooks and the HF switch."""

    engine: Any
    optimizer: Any
    mesh: HybridMesh
    undo: Callable[[], None]


@contextlib.contextmanager
def without_cpu_shm_comm_build():
    """On a CPU accelerator, stop DeepSpeed from JIT-compiling its shared-memory all-reduce.

    DeepSpeed's comm backend builds ``deepspeed_shm_comm`` when it first initialises on CPU
    (about two minutes on two cores, silently); hybridsp trains over gloo, which never uses
    it. The op is marked incompatible only for the duration of the block, then restored.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    compatible = deepspeed.ops.__compatible_ops__
    if get_accelerator().device_name() != "cpu" or "deepspeed_shm_comm" not in compatible:
        yield
        return
    before = compatible["deepspeed_shm_comm"]
    compatible["deepspeed_shm_comm"] = False
    try:
        yield
    finally:
        compatible["deepspeed_shm_comm"] = before


def init_distributed(timeout: datetime.timedelta | None = None) -> None:
    """``deepspeed.init_distributed`` (adopting an existing process group) without the CPU shm-comm
    build, with a collective ``timeout`` (Note [timeouts]); a no-op when already initialised.
    Sets ``GLOO_SOCKET_IFNAME`` first where gloo would advertise loopback to other hosts
    (Note [gloo interface] in :mod:`hybridsp.launch._gloo_interface`)."""
    import deepspeed

    from hybridsp.launch._gloo_interface import choose_gloo_interface

    if dist.is_initialized():
        return
    choose_gloo_interface()
    kwargs = {} if timeout is None else {"timeout": timeout}
    with without_cpu_shm_comm_build():
        deepspeed.init_distributed(**kwargs)


def initialize(
    model: nn.Module,
    config: dict | str | os.PathLike,
    *,
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
    ulysses: int | None = None,
    ring: int | None = None,
    backend: str | None = None,
    precision: str | None = None,
    kv_comm: str | None = None,
    layout: str | None = None,
    tensor: int | None = None,
    switch_attention: AttentionSwitch | None = None,
) -> HybridEngine:
    """``deepspeed.initialize`` with the hybrid mesh: returns ``(engine, optimizer, mesh, undo)``.

        Reads the ``"hybridsp"`` section of ``config`` (a dict or a JSON path; ``ulysses``, ``ring``,
        ``backend``, ``kv_comm`` and ``layout`` override it), builds the mesh over all ranks (initialising torch.distributed
        through DeepSpeed if needed), calls ``switch_attention(model, mesh, backend)`` (the caller's attention
    switch, e.g. the transformers integration's; it returns its undo), passes
        DeepSpeed a :class:`HybridMPU` and the cleaned config, and on ZeRO-3 with ``C > 1`` adds the
        gradient hooks of Note [gradient scale]. ``precision`` forces the value of
        ``"auto"`` precision sections. A ``"compile": {"enabled": true, "backend": ..., "kwargs": {...}}``
        section compiles the engine (``engine.compile``; :mod:`hybridsp.integrations.deepspeed._compiling`).
        Raises ValueError, before any process group is created, for a config whose sizes disagree. ``undo()`` removes what this call added to the model (the
        ZeRO-3 gradient hooks, the attention switch); the engine is not usable after it.
    """
    import deepspeed

    raw = load_config(config)
    hybrid = HybridConfig.from_ds_config(
        raw, ulysses=ulysses, ring=ring, backend=backend, kv_comm=kv_comm, layout=layout, tensor=tensor
    )
    ds_config = deepspeed_config(raw, hybrid, precision=precision)
    compiling = compile_settings(raw)
    check_tensor_optimizer(optimizer, hybrid.tensor)
    with without_cpu_shm_comm_build():
        deepspeed.init_distributed()  # adopts an existing process group
        mesh = build_mesh(hybrid)
        split_tensors(model, mesh, hybrid.tensor_sequence_parallel)  # hybridsp.integrations.deepspeed._tensor
        undo_switch = _no_undo if switch_attention is None else switch_attention(model, mesh, hybrid.backend)
        try:
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                config=ds_config,
                mpu=HybridMPU(mesh),
                model_parameters=model.parameters() if model_parameters is None else model_parameters,
            )
            stage = engine.zero_optimization_stage()
            undo_norm = count_tensor_shards_in_norm(ds_optimizer, mesh, stage)  # Note [tensor-parallel gradient norm]
        except BaseException:
            undo_switch()
            raise
    remove_hooks = _no_undo
    if stage == 3 and mesh.context > 1:
        remove_hooks = scale_gradients(engine.module, mesh.context)  # Note [gradient scale]

    def undo() -> None:
        remove_hooks()
        undo_norm()
        undo_switch()

    try:
        compiling.apply(engine)  # "compile": {"enabled": true, ...}: hybridsp.integrations.deepspeed._compiling
    except BaseException:
        undo()  # a compile that fails leaves the model as it came
        raise
    return HybridEngine(engine, ds_optimizer, mesh, undo)
