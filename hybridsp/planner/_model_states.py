"""Persistent bytes of one rank (the "Persistent" terms of :mod:`hybridsp.planner._memory`): the
ZeRO-partitioned model states, what ZeRO-Offload keeps in host memory, and DeepSpeed's gradient bucket."""

from __future__ import annotations

from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload

ADAM_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m + Adam v
HOST_GRAD_BYTES_PER_PARAM = 4  # ZeRO-Offload's fp32 gradient partition in host memory


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_state_bytes(
    model: ModelSpec,
    zero_stage: int,
    shards: int,
    forward_only: bool,
    dtype_bytes: int = 2,
    optimizer_offload: bool = False,
    param_offload: bool = False,
    prefetch_bucket: int | None = None,
) -> tuple[int, ...]:
    """(params, grads, optimizer, gathered) device bytes: e + e + 12 per param, ZeRO-partitioned.

    Stage 1 partitions the optimizer states, 2 adds gradients, 3 adds parameters (and then
    holds gathered parameters: the largest unit of a layer and the embedding, u, plus what is
    prefetched, max(u, prefetch_bucket), at most the whole model; without ``prefetch_bucket``
    two units). Offload moves the optimizer states and gradients (ZeRO >= 1) or the parameter
    partition (ZeRO-3) to host.
    """
    psi, e = model.total_params, dtype_bytes
    params = _ceil_div(e * psi, shards) if zero_stage == 3 else e * psi
    if param_offload and zero_stage == 3:
        params = 0
    unit = max(model.layer_params, model.embedding_params)
    ahead = unit if prefetch_bucket is None else max(unit, prefetch_bucket)
    gathered = (
        e * min(psi if prefetch_bucket is not None else 2 * unit, unit + ahead) if zero_stage == 3 and shards > 1 else 0
    )
    if forward_only:
        return params, 0, 0, gathered
    grads = _ceil_div(e * psi, shards) if zero_stage >= 2 else e * psi
    optimizer = _ceil_div(ADAM_BYTES_PER_PARAM * psi, shards) if zero_stage >= 1 else ADAM_BYTES_PER_PARAM * psi
    if optimizer_offload and zero_stage >= 1:
        grads = optimizer = 0
    return params, grads, optimizer, gathered


def host_state_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> tuple[int, int]:
    """(optimizer, params) bytes this rank keeps in host memory under ZeRO-Offload."""
    tech, psi, shards = workload.techniques, model.total_params, config.world_size
    optimizer = params = 0
    if not workload.forward_only and tech.optimizer_offload and config.zero_stage >= 1:
        optimizer = _ceil_div((ADAM_BYTES_PER_PARAM + HOST_GRAD_BYTES_PER_PARAM) * psi, shards)
    if tech.param_offload and config.zero_stage == 3:
        params = _ceil_div(workload.dtype_bytes * psi, shards)
    return optimizer, params


def engine_state_bytes(workload: Workload, config: MeshConfig) -> int:
    """DeepSpeed's contiguous gradient bucket: ``reduce_bucket`` elements of e (ZeRO >= 1, training)."""
    if workload.forward_only or config.zero_stage == 0:
        return 0
    return workload.techniques.reduce_bucket * workload.dtype_bytes
