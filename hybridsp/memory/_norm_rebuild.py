"""Projections that keep the norm's input, not its output: one ``[B, S_local, h]`` fewer at the attention backward.

Under split checkpointing (:mod:`hybridsp.memory._split_checkpoint`) the attention half's recompute
runs ``input_layernorm(x)`` and hands the result to the q/k/v projections, which keep it for their
weight gradients. Their backward comes last in the half's backward, so the norm's output stays alive
through the attention's own backward, the step's peak once q/k/v are donated (measured by
``benchmarks.memory.step_peak``: one of the 9.4 vectors live there at S = 49,152), although the half
keeps x, from which the norm makes it, anyway.

:class:`NormInputKept` is a pair of saved-tensor hooks around the half. A tensor saved inside it that
views the norm's output (the output itself, a ``[T, h]`` view ``F.linear`` keeps, the
``input.detach()`` DeepSpeed ZeRO-3 hands each module: same storage, unchanged version) is kept as x
and rebuilt on unpack by the norm's own ``forward`` on x, without autograd, under the autocast state of
the forward, its parameters gathered (:func:`hybridsp.memory._sharded_params.gathered`): the same ops
on the same input, so bit for bit the rows the projections saw. The three projections share one
rebuild (the first unpack makes it, the last one drops it). Every other saved tensor, and x itself,
goes to the enclosing hooks unchanged (torch's non-reentrant checkpoint keeps x anyway as the region's
input; a reentrant checkpoint's recompute has no enclosing hooks and x is its input), so the
checkpoint still sees the same saves in the same order in its forward and its recompute.

Nothing is rebuilt while dynamo traces (the hooks stay off), for a norm output that is not contiguous,
or for a saved tensor whose version moved since the norm made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hybridsp.memory._sharded_params import gathered

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def enclosing_hooks() -> Hooks | None:
    """The innermost saved-tensor hooks (pack, unpack) that are not a :class:`NormInputKept`'s (those hand
    every other tensor on to the hooks they enclose); None when there are none."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    hooks: Hooks | None = (top[0], top[1]) if top else None
    while hooks is not None and isinstance(owner := getattr(hooks[0], "__self__", None), NormInputKept):
        hooks = owner._outer
    return hooks


@dataclass
class _SharedRebuild:
    """One scope's rebuild of the norm's output, shared by its recipes (made once, dropped after the last)."""

    norm: nn.Module
    shape: tuple[int, ...]  # the output's, as the forward made it (contiguous)
    autocast: tuple[str, bool, torch.dtype]  # (device type, enabled, dtype) when the norm ran
    pending: int = 0  # recipes made and not yet unpacked
    rows: torch.Tensor | None = None

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The norm's output rebuilt from x (cached until every recipe has been unpacked)."""
        rows = self.rows if self.rows is not None else self._rebuild(x)
        self.pending -= 1
        self.rows = rows if self.pending > 0 else None
        return rows

    def _rebuild(self, x: torch.Tensor) -> torch.Tensor:
        device_type, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype, enabled), gathered(self.norm.parameters()):
            rows = torch.as_tensor(self.norm.forward(x))
        if tuple(rows.shape) != self.shape or not rows.is_contiguous():
            raise RuntimeError(
                f"the norm's rebuilt output is {tuple(rows.shape)} (contiguous: {rows.is_contiguous()}), its forward "
                f"made {self.shape}: the norm is not a function of its input alone"
            )
        return rows


@dataclass
class _Recipe:
    """A saved view of the norm's output: x (packed by the enclosing hooks) and where the view sits."""

    shared: _SharedRebuild
    x: Any
    unpack_x: Callable[[Any], torch.Tensor] | None
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements from the output's first element

    def tensor(self) -> torch.Tensor:
        """The saved view, rebuilt."""
        x = self.x if self.unpack_x is None else self.unpack_x(self.x)
        rows = self.shared.output(x)
        return rows.as_strided(self.size, self.stride, rows.storage_offset() + self.offset)


class NormInputKept:
    """Saved-tensor hooks under which views of ``norm(x)``'s output are kept as x and rebuilt (module docstring).

    Usage::

        with NormInputKept(layer.input_layernorm, x) as kept:
            attended = layer.self_attn(kept.normalized(), ...)
    """

    def __init__(self, norm: nn.Module, x: torch.Tensor) -> None:
        self._norm = norm
        self._x: torch.Tensor | None = x
        self._output: torch.Tensor | None = None
        self._version = 0
        self._outer: Hooks | None = None
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._shared: _SharedRebuild | None = None

    def __enter__(self) -> NormInputKept:
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return self
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer = (top[0], top[1]) if top else None  # a NormInputKept's too: it hands on the rest
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._output = self._x = None  # the graph keeps this object (its unpack hook), not these
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None

    def normalized(self) -> torch.Tensor:
        """``norm(x)`` (the module called, hooks and all); its views saved from now on are rebuilt."""
        if self._x is None:
            raise RuntimeError("NormInputKept.normalized() is called inside its with-block, once it has exited never")
        out = torch.as_tensor(self._norm(self._x))
        if self._hooks is not None and out.is_contiguous() and out.numel() > 0:
            self._output, self._version = out, out._version
            device_type = out.device.type
            autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
            self._shared = _SharedRebuild(self._norm, tuple(out.shape), autocast)
        return out

    def _views_output(self, saved: torch.Tensor) -> bool:
        out = self._output
        if out is None or saved.dtype != out.dtype or saved.device != out.device or saved._version != self._version:
            return False
        if saved.untyped_storage().data_ptr() != out.untyped_storage().data_ptr() or saved.numel() == 0:
            return False
        first = saved.storage_offset() - out.storage_offset()
        last = first + sum((n - 1) * s for n, s in zip(saved.shape, saved.stride()))
        return 0 <= first and last < out.numel() and min(saved.stride(), default=1) >= 0

    def _pack(self, saved: torch.Tensor) -> Any:
        if self._views_output(saved):
            assert self._shared is not None and self._output is not None  # set with _output
            self._shared.pending += 1
            assert self._x is not None  # set while the hooks are on
            x = self._outer[0](self._x) if self._outer else self._x
            offset = int(saved.storage_offset() - self._output.storage_offset())
            return _Recipe(
                self._shared, x, self._outer[1] if self._outer else None, tuple(saved.shape), saved.stride(), offset
            )
        return self._outer[0](saved) if self._outer else saved

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Recipe):
            return packed.tensor()
        return self._outer[1](packed) if self._outer else packed
