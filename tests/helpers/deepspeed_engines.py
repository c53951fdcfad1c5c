"""DeepSpeed engines in the tests: no JIT builds on gloo, and an engine's full gradients and parameters."""

import os

import torch
import torch.distributed as dist


def forbid_jit_builds(directory: str) -> str:
    """Point torch extensions at an empty folder and skip DeepSpeed's shm comm build (gloo never uses it)."""
    extensions = os.path.join(directory, f"torch_extensions_rank{dist.get_rank()}")
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # else its first init JIT-builds (~2 min)
    return extensions


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def full_grads(engine) -> torch.Tensor:
    """Every parameter's reduced gradient, unpartitioned (valid after the boundary backward)."""
    from deepspeed.utils import safe_get_full_grad

    return flat(safe_get_full_grad(p) for p in engine.module.parameters())


def full_params(engine) -> torch.Tensor:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return flat(params)
