"""A model sharded with PyTorch FSDP2 (``fully_shard``) over the hybrid mesh's data x context ranks.

    mesh = hybridsp.init_mesh(ulysses=2, ring=2)        # or init_mesh(device_mesh=your_mesh)
    hf.apply(model, mesh)                                # the switch first: it binds the attention modules
    fully_shard_model(model, mesh)                       # each decoder layer, then the root, over mesh.fsdp_mesh
    ...                                                  # shard_batch, the token-weighted loss, backward
    norm = clip_grad_norm_(model.parameters(), 1.0)      # the whole model's norm (a plain tensor)

Note [gradient scale under FSDP2]: FSDP2 reduce-scatters each gradient over the ``"dp_cp"`` dim
(all ``W = DP x C`` ranks) and divides by ``W``. A rank's loss gradient is its share of its
replica's loss (the context ranks hold different tokens of one batch: their gradients are partial
and only their sum is the replica's gradient), so the right divisor is ``DP``, the number of
replicas: :func:`fully_shard_model` sets it on every FSDP module (``set_gradient_divide_factor``).
The sharded gradient is then the plain data-parallel run's, and the norm, the clipping and the
optimizer step match one process.

Note [what FSDP2 does not compose with here]: our tensor-parallel axis (``tensor > 1``: the model is
split in place by :mod:`hybridsp.tensor_parallel` with plain tensors, not DTensors over a ``"tensor"``
dim, and FSDP2 would mix the tensor ranks' different shards) and pipeline parallelism (hybridsp has
none) are refused by :func:`check_fsdp2_mesh` before any collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hybridsp.mesh._hybrid_mesh import HybridMesh


def check_fsdp2_mesh(mesh: HybridMesh) -> None:
    """ValueError, no communication, for a mesh FSDP2 cannot shard over here (Note [what FSDP2 ...])."""
    if mesh.tensor > 1:
        raise ValueError(
            f"FSDP2 does not compose with hybridsp's tensor axis (tensor={mesh.tensor}): set tensor=1, or train "
            "tensor parallelism through hybridsp.integrations.deepspeed.initialize (docs/tensor-parallel.md)"
        )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules each sharded on their own: those whose class is in the model's ``_no_split_modules``
    (a transformers model's decoder layers); ValueError when there are none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer class in _no_split_modules ({sorted(names)}); pass "
            "layers= to fully_shard_model (the blocks to shard one by one, e.g. model.model.layers)"
        )
    return layers


def fully_shard_model(
    model: nn.Module,
    mesh: HybridMesh,
    *,
    layers: Iterable[nn.Module] | None = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """``fully_shard`` each decoder layer, then the root, over ``mesh.fsdp_mesh``; returns ``model``.

    Every parameter becomes a DTensor sharded over all ``DP x U x R`` ranks (dim 0, ``Shard(0)``);
    gradients are divided by ``DP`` (Note [gradient scale under FSDP2]). ``mp_policy`` (a
    ``MixedPrecisionPolicy``, e.g. bf16 compute over fp32 parameters) and ``offload_policy``
    (``CPUOffloadPolicy``) pass through to ``fully_shard``. Apply the switch (``hf.apply``) first.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    check_fsdp2_mesh(mesh)
    options: dict[str, Any] = dict(
        mesh=mesh.fsdp_mesh,
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        offload_policy=offload_policy or OffloadPolicy(),
        reshard_after_forward=reshard_after_forward,
    )
    for layer in list(layers) if layers is not None else decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    set_replica_divisor(model, mesh)
    return model


def set_replica_divisor(model: nn.Module, mesh: HybridMesh) -> None:
    """Divide the reduce-scattered gradients by DP on every FSDP module (Note [gradient scale under FSDP2])."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    gloo = dist.get_backend(mesh.data_context_group) == "gloo"  # gloo has no PREMUL_SUM: sum, then divide
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(mesh.dp))
            if gloo:
                module.set_force_sum_reduction_for_comms(True)


def is_fully_sharded(model: nn.Module) -> bool:
    """Every parameter is a DTensor (what ``fully_shard`` leaves)."""
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of DTensor (or plain) parameters to ``max_norm``; returns the total norm before
    clipping as a plain tensor (the whole model's, over every shard: one all-reduce)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)  # type: ignore[misc]
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
