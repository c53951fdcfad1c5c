"""What diffusers' own context parallelism needs to run on a CPU-only torch with gloo (e.diffusers_cp's ranks).

diffusers 0.42.1's ``ContextParallelConfig`` does not run on this machine as shipped:

1. ``model.enable_parallelism(config=...)`` fails before any collective: ``_resolve_parallel_config``
   (diffusers/models/modeling_utils.py, line 1719) computes
   ``torch.device(device_type, rank % torch.accelerator.device_count())``, and a CPU-only torch has
   ``device_count() == 0``: ``ZeroDivisionError: integer modulo by zero``. :func:`enable_context_parallel`
   makes ``device_count()`` answer 1 for the length of that call only (the device becomes ``cpu:0``).
2. The ring (``ring_degree > 1``) needs each block's log-sum-exp. The one CPU backend, ``native`` (SDPA),
   raises ``ValueError: Native attention does not support return_lse=True`` (attention_dispatch.py,
   line 876); every other backend with context parallelism (``flash``, ``_native_flash``,
   ``_native_cudnn``, ``sage``, ...) is a CUDA kernel. ``_native_flash`` calls
   ``torch.ops.aten._scaled_dot_product_flash_attention`` (line 1097), which has no CPU kernel
   (``NotImplementedError: Could not run 'aten::_scaled_dot_product_flash_attention' with arguments from
   the 'CPU' backend``). :func:`cpu_flash_kernel` registers torch's CPU flash kernels
   (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, what hybridsp's ``backend="torch"``
   calls) as that op's and its backward's CPU kernels, so diffusers' ring code runs unchanged.
3. The top-level hook wants a tuple: the model is called with ``return_dict=False`` (as diffusers'
   pipelines call it); ``.sample`` of a ``Transformer2DModelOutput`` fails in
   hooks/context_parallel.py, line 192 ("Expected output to be a tensor or a list/tuple of tensors").

:class:`SentBytes` counts what a rank sends through torch.distributed (``harness.ByteCounter``, plus
``all_gather`` of a list) and through the functional collectives diffusers uses
(``all_to_all_single``, ``all_gather_tensor``, ``permute_tensor``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from benchmarks.common import harness


def enable_context_parallel(model: torch.nn.Module, ulysses: int, ring: int, backend: str) -> Any:
    """diffusers' ``ContextParallelConfig(ulysses_degree, ring_degree)`` on ``model`` with ``backend``."""
    from diffusers import ContextParallelConfig

    model.set_attention_backend(backend)
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1  # type: ignore[assignment]  # see the module docstring, 1.
    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    finally:
        torch.accelerator.device_count = count  # type: ignore[assignment]
    return model._parallel_config


def _flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention on CPU: q, k, v [B, H, S, D] -> (out, lse [B, H, S], ...)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )
    empty = query.new_empty(0, dtype=torch.int64)  # cumulative lengths and RNG state: unused without dropout
    return out, lse, empty, empty, query.shape[2], key.shape[2], empty, empty, query.new_empty(0)


def _flash_backward(
    grad_out, query, key, value, out, logsumexp, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset,
    *, scale=None,
):  # fmt: skip
    """aten::_scaled_dot_product_flash_attention_backward on CPU -> (dq, dk, dv) [B, H, S, D]."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale
    )


@contextmanager
def cpu_flash_kernel() -> Iterator[None]:
    """torch's CPU flash kernels as the CPU kernels of the CUDA flash op diffusers' ``_native_flash`` calls."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("_scaled_dot_product_flash_attention", _flash_forward, "CPU")
    library.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")
    try:
        yield
    finally:
        library._destroy()


def _group_size(group: Any) -> int:
    if isinstance(group, (list, tuple)):
        return len(group)
    if hasattr(group, "size") and not isinstance(group, dist.ProcessGroup):
        return int(group.size())  # a DeviceMesh
    return dist.get_world_size(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class SentBytes(harness.ByteCounter):
    """``bytes``: kind -> bytes this rank sent, torch.distributed's calls and the functional collectives.

    All-gathers count the ring algorithm's ``(W - 1) x`` the local part (as ``ByteCounter`` does),
    all-to-alls ``(W - 1) / W`` of the input, ``permute_tensor`` its input (sent to one other rank).
    """

    _FUNCTIONAL = ("all_to_all_single", "all_gather_tensor", "permute_tensor")

    def __enter__(self):
        super().__enter__()
        self._functional = {name: getattr(funcol, name) for name in self._FUNCTIONAL}
        self._permuting = False
        saved, add = self._functional, self._add

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            add("all_gather", _nbytes(tensor) * (dist.get_world_size(group) - 1))
            return self._saved["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

        def all_to_all_single(tensor, output_split_sizes, input_split_sizes, group, tag=""):
            if not self._permuting:  # permute_tensor's own all-to-all is counted there
                size = _group_size(group)
                add("all_to_all", _nbytes(tensor) * (size - 1) // size)
            return saved["all_to_all_single"](tensor, output_split_sizes, input_split_sizes, group, tag)

        def all_gather_tensor(tensor, gather_dim, group, tag=""):
            add("all_gather", _nbytes(tensor) * (_group_size(group) - 1))
            return saved["all_gather_tensor"](tensor, gather_dim, group, tag)

        def permute_tensor(tensor, src_dst, group, tag=""):
            add("p2p", _nbytes(tensor))  # to one other rank (diffusers' ring shifts by one)
            self._permuting = True  # torch posts it as an all-to-all with one non-empty part
            try:
                return saved["permute_tensor"](tensor, src_dst, group, tag)
            finally:
                self._permuting = False

        dist.all_gather = all_gather
        funcol.all_to_all_single = all_to_all_single
        funcol.all_gather_tensor = all_gather_tensor
        funcol.permute_tensor = permute_tensor
        return self

    def __exit__(self, *exc):
        for name, fn in self._functional.items():
            setattr(funcol, name, fn)
        return super().__exit__(*exc)
