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

Note [when it rebuilds]: only where the rebuild is the forward's own result: the call's output is the
norm's ``forward`` return unchanged (a forward hook that returns another tensor or writes into it, or any
global module hook, turns it off; DeepSpeed ZeRO-3's ``detach()`` alias keeps it on) on the half's input
itself; the output is contiguous; the autocast state can be read on its device; dynamo is not tracing.
The rebuild gathers the norm's parameters (:func:`hybridsp.memory._sharded_params.gathered`, as the tiled
MLP's backward does); a ZeRO-3 parameter that DeepSpeed's backward prefetch has in flight at that moment
cannot be gathered (``GatheredParameters`` skips it too) and raises RuntimeError saying so, rather than
reading its empty placeholder (not seen on CPU; the shipped configs keep norms persistent). The norm's forward must
be a function of its input and parameters (every transformers norm is). Otherwise the half runs as
before: the projections keep the output. Under autocast with fp32 weights the projections keep their own
low-precision casts, not the output, so nothing is rebuilt there.

Note [rebuild cache]: the rows are rebuilt once per backward (graph task) and shared by that backward's
unpacks (the three projections'); the last one drops them. A save that a backward never unpacks keeps
them until that backward's graph is freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from hybridsp.memory._aliases import same_elements
from hybridsp.memory._sharded_params import gathered

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
Autocast = tuple[str, bool, torch.dtype]  # (device type, enabled, dtype)


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
    """One scope's rebuild of the norm's output, shared by its recipes (Note [rebuild cache])."""

    norm: nn.Module
    made: tuple[torch.Size, torch.dtype, torch.device]  # the output's shape, dtype, device
    autocast: Autocast  # when the norm ran
    recipes: int = 0  # made in the forward
    task: int | None = None  # the backward the cache belongs to
    remaining: int = 0  # its unpacks still to come
    rows: torch.Tensor | None = None

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The norm's output rebuilt from x, once per backward."""
        task = torch._C._current_graph_task_id()
        if task != self.task or (self.rows is None and self.remaining <= 0):
            self.task, self.remaining, self.rows = task, self.recipes, None
        rows = self.rows if self.rows is not None else self._rebuild(x)
        self.remaining -= 1
        self.rows = rows if self.remaining > 0 else None
        return rows

    def _rebuild(self, x: torch.Tensor) -> torch.Tensor:
        device_type, enabled, dtype = self.autocast
        with torch.no_grad(), torch.autocast(device_type, dtype, enabled), gathered(self.norm.parameters()):
            if any(p.numel() == 0 for p in self.norm.parameters()):  # Note [when it rebuilds]: ZeRO-3 in flight
                raise RuntimeError(
                    f"{type(self.norm).__name__}'s parameters are not gathered in the backward (a ZeRO-3 prefetch "
                    "in flight): raise stage3_param_persistence_threshold above the norm's size, or leave split "
                    "checkpointing off"
                )
            rows = torch.as_tensor(self.norm.forward(x))
        if (rows.shape, rows.dtype, rows.device) != self.made or not rows.is_contiguous():
            raise RuntimeError(
                f"the norm's rebuilt output is {tuple(rows.shape)} {rows.dtype} on {rows.device} (contiguous: "
                f"{rows.is_contiguous()}), its forward made {self.made}: "
                f"{type(self.norm).__name__} is not a function of its input and parameters"
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


def _record_call(
    seen: dict[str, Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    """A forward hook (prepended): what the norm's forward received and returned, before other hooks."""
    seen["input"] = args[0] if args else next(iter(kwargs.values()), None)
    seen["output"] = output
    seen["version"] = output._version if isinstance(output, torch.Tensor) else None


def _autocast_state(device_type: str) -> Autocast | None:
    """(device type, enabled, dtype) of autocast now; None where autocast knows no such device (meta, ...)."""
    try:
        return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (RuntimeError, AssertionError, ValueError):
        return None


def _global_module_hooks() -> bool:
    """Any forward (pre-)hook registered for every module (``torch.nn.modules.module``'s globals)."""
    module = torch.nn.modules.module
    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


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
        """``norm(x)`` (the module called, hooks and all); its views saved from now on are rebuilt where
        Note [when it rebuilds] allows."""
        if self._x is None:
            raise RuntimeError("NormInputKept.normalized() is called inside its with-block, once it has exited never")
        seen: dict[str, Any] = {}
        handle = self._norm.register_forward_hook(partial(_record_call, seen), prepend=True, with_kwargs=True)
        try:
            out = torch.as_tensor(self._norm(self._x))
        finally:
            handle.remove()
        autocast = _autocast_state(out.device.type)
        if self._hooks is not None and autocast is not None and self._rebuilds(out, seen):
            self._output, self._version = out, out._version
            self._shared = _SharedRebuild(self._norm, (out.shape, out.dtype, out.device), autocast)
        return out

    def _rebuilds(self, out: torch.Tensor, seen: dict[str, Any]) -> bool:
        """Whether ``out`` is what ``norm.forward(x)`` makes again (Note [when it rebuilds])."""
        forward_made = same_elements(seen.get("output"), out) and seen.get("version") == out._version
        return (
            forward_made
            and self._x is not None
            and same_elements(seen.get("input"), self._x)
            and not _global_module_hooks()
            and out.is_contiguous()
            and out.numel() > 0
        )

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
            assert self._shared is not None and self._output is not None and self._x is not None  # set together
            self._shared.recipes += 1
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
