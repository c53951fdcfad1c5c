"""Activation-checkpoint offload: the inputs kept between checkpointed layers live in host memory.

    model.gradient_checkpointing_enable()              # HF; non-reentrant is transformers 5's default
    offload = hybridsp.offload_activations(model)     # once; offload.remove() takes the hooks off
    for batch in loader:
        with offload:                                  # around the forward (the backward may be outside)
            loss = ...forward...
        engine.backward(loss)

With activation checkpointing a layer keeps only its input, ``[B, S/C, h]`` per layer, for
the backward (which recomputes the layer from it). Over ``L`` layers those inputs are the
largest S-dependent term left once the loss and the MLP are tiled (fp32 logits aside). This
module moves each of them to host memory as soon as the next layer has started and brings it
back, one layer ahead, during the backward.

Note [how the inputs are found]: non-reentrant ``torch.utils.checkpoint`` (and the reentrant
one) saves a checkpointed region's inputs with ``ctx.save_for_backward`` *outside* the region's
own saved-tensor hooks, so an enclosing :class:`torch.autograd.graph.saved_tensors_hooks` sees
exactly those inputs, plus whatever is saved outside every checkpointed region (embedding,
final norm, LM head, loss). A forward pre-hook on each checkpointed layer marks its first
positional tensor (HF decoder layers take ``hidden_states`` first); the pack hook offloads
a saved tensor only when it *is* that marked object (Note [hook order]) and leaves everything else on
the device. So the
LM head's input and the logits stay where they are (the backward needs them first), and
nothing inside a layer is touched. The hooks are per model instance (``remove()`` takes them
off); no class or module global is patched.

Note [hook order]: transformers before 5.25 checkpoint a layer's ``__call__`` (its forward hooks run
inside the checkpointed region: after a non-reentrant checkpoint saved the input, before a
reentrant one does, with gradients off); later ones checkpoint ``forward`` (the hooks run first).
Every order is met: a marked tensor is claimed when saved, and a tensor saved while nothing is
marked gets a handle that stays on the device unless the next pre-hook names it (then it is claimed
there). Each pre-hook drops the earlier marks and unclaimed handles: a layer's input is saved before
the next layer starts. (Before this, the hooks-inside order offloaded nothing, silently.)

Note [split layers]: under :func:`hybridsp.memory.apply_split_checkpointing` a layer is two
checkpointed regions and keeps two inputs, ``x`` and the attention half's output ``h1``; the MLP
half's first module (``post_attention_layernorm``) gets the same marking pre-hook, so ``h1`` goes to
host like ``x`` (in the backward the MLP half needs ``h1`` first, then the attention half ``x``).

Note [aliases]: a marked input is matched to a saved tensor by identity or as an alias of the same
elements (same storage, offset, shape, strides, dtype): DeepSpeed ZeRO-3's module pre-hooks hand a
module ``input.detach()`` (a new tensor object on the same storage), so the MLP half's entry module
sees an alias of the ``h1`` that the checkpoint saved (found by ``benchmarks.memory.step_peak``).

Note [streams and the last layers]: on CUDA the device-to-host copy of layer ``i``'s input runs
on a side stream when layer ``i + 1`` starts (into pinned memory from torch's caching host
allocator), so it overlaps layer ``i + 1``'s compute; ``record_stream`` keeps the device block
alive until the copy is done. The newest ``keep_last`` inputs (default 1) never leave the
device: the backward needs them before a copy could return. In the backward, restoring layer
``i``'s input also starts the host-to-device copy of layer ``i - 1``'s (prefetch), so that
copy overlaps layer ``i``'s recompute and backward; the compute stream waits on an event
before it reads a restored tensor. On CPU the same path runs synchronously: the "host" copy is
a fresh tensor (from ``host_allocator``, e.g. one outside a memory budget) and the restore
copies it back, so results are bitwise those of plain checkpointing. A tensor restored on CUDA is
allocated on the side stream that fills it, so its block goes back to that stream's pool of torch's
caching allocator: reserved (not allocated) device memory may grow by a layer input or two.

Note [strides], Note [in-place changes] and Note [disk] are in :mod:`hybridsp.memory._saved` (the
handle each offloaded input gets): restored inputs keep the saved strides and alignment, an input
changed in place before its copy is taken raises in the backward, and with ``spill_dir`` the inputs go to
unlinked files on a local disk.

Why not DeepSpeed 0.19.8's ``CheckpointHiddenStatesOffload`` or torch's ``save_on_cpu``:
DeepSpeed's skips every tensor on a CPU accelerator (so the path cannot run or be tested
without a GPU), patches ``GradientCheckpointingLayer.__call__`` on the class while active,
and must enclose the backward too (it drops its state on exit). ``save_on_cpu`` offloads every
tensor saved outside the checkpointed regions as well (the logits and the loss's saved
log-softmax, which the backward needs at once), copies on the compute stream, and restores
each tensor only when autograd asks for it (no prefetch).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import torch
from torch import nn

from hybridsp.memory._aliases import same_elements
from hybridsp.memory._saved import SavedInput, nbytes
from hybridsp.memory._spill import DiskTier
from hybridsp.memory._split_checkpoint import second_half_entry

HostAllocator = Callable[[torch.Size, torch.dtype], torch.Tensor]


@dataclass
class OffloadStats:
    """Counts since the last ``__enter__``: tensors and bytes sent off the device (``offloaded_bytes``:
    what one forward sends to host memory, or with ``spill_dir`` on to disk (``spilled_bytes``, then
    equal); each copy is freed with its graph), kept on the device (the newest ``keep_last``), restored
    in the backward."""

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    spilled_bytes: int = 0
    kept_tensors: int = 0
    restored_tensors: int = 0


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep checkpointed layers' inputs in host memory (module docstring).

    Args:
        model: the model whose checkpointed layers are found (modules with a true
            ``gradient_checkpointing`` attribute, as HF ``GradientCheckpointingLayer`` sets), or
            ``layers`` given explicitly.
        layers: the checkpointed modules whose first positional tensor argument is offloaded.
        enabled: ``False`` makes the context a no-op (the switch behind ``--offload-activations``).
        keep_last: the newest inputs that stay on the device (>= 0).
        min_bytes: smaller inputs are not offloaded.
        prefetch: restore the previous layer's input while the current one runs backward.
        host_allocator: ``(shape, dtype) -> CPU tensor`` for the host copies; default
            ``torch.empty`` (pinned when the inputs are on CUDA). With ``spill_dir`` only CUDA uses
            it (the staging copy a write starts from); on CPU the tensor itself is written.
        spill_dir: a directory on a local disk: the offloaded inputs are written to unlinked files
            there instead of staying in host memory (:mod:`hybridsp.memory._spill`, Note [disk] in
            :mod:`hybridsp.memory._saved`);
            ValueError when it is not a writable directory.

    Enter it around the forward (each ``with`` resets :attr:`stats`); the backward may run
    after the block. Outputs are bitwise those of the same checkpointed model without offload.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        layers: Iterable[nn.Module] | None = None,
        enabled: bool = True,
        keep_last: int = 1,
        min_bytes: int = 1024,
        prefetch: bool = True,
        host_allocator: HostAllocator | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
    ):
        if not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"keep_last must be an integer >= 0; got {keep_last!r}")
        if not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an integer >= 0; got {min_bytes!r}")
        super().__init__(self._pack, self._unpack)
        self.enabled, self.keep_last, self.min_bytes, self.prefetch = enabled, keep_last, min_bytes, prefetch
        self._custom_allocator = host_allocator
        self.disk = DiskTier(spill_dir) if spill_dir is not None and enabled else None
        self.stats = OffloadStats()
        self.layers = list(layers) if layers is not None else self._checkpointed_layers(model)
        if enabled and not self.layers:
            raise ValueError(
                "no checkpointed layer found: offloading activations needs activation checkpointing "
                "(model.gradient_checkpointing_enable() on a Hugging Face model), or pass layers=[...]"
            )
        self._handles = [layer.register_forward_pre_hook(self._mark, with_kwargs=True) for layer in self.layers]
        self._entries: set[int] = set()  # the split layers' MLP-half entry modules already hooked
        self._marked: list[torch.Tensor] = []
        self._unclaimed: list[SavedInput] = []
        self._kept: list[SavedInput] = []
        self._copying: list[SavedInput] = []  # offloaded, their copies maybe still running
        self._last_saved: SavedInput | None = None
        self._active = False
        self.stream: torch.cuda.Stream | None = None
        self.device = torch.device("cpu")

    @staticmethod
    def _checkpointed_layers(model: nn.Module | None) -> list[nn.Module]:
        """HF ``GradientCheckpointingLayer``s with checkpointing on (not the ``LlamaModel`` that
        also carries the flag: its first argument is the token ids)."""
        if model is None:
            raise ValueError("give the model (or layers=[...])")
        transformers = sys.modules.get("transformers")
        if transformers is None:
            return []
        from transformers.modeling_layers import GradientCheckpointingLayer

        return [
            m
            for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False) is True
        ]

    def host_allocator(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        if self._custom_allocator is not None:
            return self._custom_allocator(shape, dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=self.stream is not None)

    # ------------------------------------------------------------------ marking the inputs

    def _mark(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Mark this layer's input (or claim it, if the checkpoint saved it already); earlier marks and
        unclaimed handles are dropped: each layer's input is saved before the next layer starts."""
        self._marked, unclaimed, self._unclaimed = [], self._unclaimed, []
        self._hook_second_half(module)
        if self._active and module.training:
            first = next((a for a in args if isinstance(a, torch.Tensor)), kwargs.get("hidden_states"))
            if isinstance(first, torch.Tensor) and first.is_floating_point() and nbytes(first) >= self.min_bytes:
                saved_first = next((h for h in unclaimed if same_elements(h.device_tensor, first)), None)
                if saved_first is not None:  # the checkpoint saved it before this hook ran (Note [hook order])
                    self._claim(saved_first)
                else:  # saved after this hook: on entering the checkpoint, or (reentrant) once it returns
                    self._marked = [first]
        return None

    def _hook_second_half(self, layer: nn.Module) -> None:
        """A split-checkpointed layer (Note [split layers]) saves a second input, ``h1``, at its MLP
        half's entry module: mark that one too (hooked on first sight, whenever the split was applied)."""
        entry = second_half_entry(layer)
        if entry is not None and id(entry) not in self._entries:
            self._entries.add(id(entry))
            self._handles.append(entry.register_forward_pre_hook(self._mark, with_kwargs=True))

    # ------------------------------------------------------------------ the hooks

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | SavedInput:
        if not self._active:
            return tensor
        if any(same_elements(tensor, marked) for marked in self._marked):
            self._marked = [marked for marked in self._marked if not same_elements(tensor, marked)]
            handle = SavedInput(self, tensor)
            self._claim(handle)
            return handle
        if tensor.is_floating_point() and nbytes(tensor) >= self.min_bytes:
            handle = SavedInput(self, tensor)  # stays on the device unless the next layer's pre-hook claims it
            self._unclaimed.append(handle)
            return handle
        return tensor

    def _claim(self, handle: SavedInput) -> None:
        """``handle`` holds a checkpointed layer's input: keep it among the newest, offload the oldest."""
        tensor = handle.device_tensor
        assert tensor is not None  # claimed when saved, before any offload
        if tensor.device.type == "cuda" and self.stream is None:
            self.stream = torch.cuda.Stream(tensor.device)
        self.device = tensor.device
        handle.previous, self._last_saved = self._last_saved, handle
        self._kept.append(handle)
        while len(self._kept) > self.keep_last:
            oldest = self._kept.pop(0)
            oldest.offload()
            self._copying.append(oldest)
        self._settle_copies()

    def _settle_copies(self, wait: bool = False) -> None:
        """Let go of the device inputs whose copies to host are done (CUDA; Note [in-place changes] in
        :mod:`hybridsp.memory._saved`); ``wait``: of all of them."""
        self._copying = [handle for handle in self._copying if not handle.settle(wait)]

    @staticmethod
    def _unpack(saved: torch.Tensor | SavedInput) -> torch.Tensor:
        return saved.restore() if isinstance(saved, SavedInput) else saved

    # ------------------------------------------------------------------ context and undo

    # torch declares saved_tensors_hooks' __enter__/__exit__ as returning None; this one hands out itself
    def __enter__(self) -> ActivationOffload:  # type: ignore[override]
        if not self.enabled:
            return self
        self.stats = OffloadStats()
        self._marked, self._unclaimed, self._kept, self._last_saved = [], [], [], None
        if self.disk is not None:
            self.disk.clear_failures()  # of a step that stopped before its backward
        self._active = True
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> Literal[False]:  # type: ignore[override]
        if not self.enabled:
            return False
        self._active = False
        self.stats.kept_tensors += len(self._kept)
        self._marked, self._unclaimed, self._kept, self._last_saved = [], [], [], None
        self._settle_copies(wait=True)  # the last copy began a layer and the loss ago; nothing held past here
        super().__exit__(*exc)
        if self.disk is not None and exc[0] is None:
            self.disk.check()  # a write that already failed stops the step here
        return False

    def remove(self) -> None:
        """Take the marking hooks off the layers (the object is unusable afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._entries = [], set()
        self.layers = []
        if self.disk is not None:
            self.disk.close()


def offload_activations(model: nn.Module, *, enabled: bool = True, **options: Any) -> ActivationOffload:
    """:class:`ActivationOffload` for ``model``'s checkpointed layers; ``options`` as its keywords."""
    return ActivationOffload(model, enabled=enabled, **options)
