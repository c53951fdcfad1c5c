"""Progress of one long forward: a line per decoder layer on rank 0, so a prefill of a million
tokens that takes minutes shows where it is (score_long.py, generate_long.py, long_video.py)."""

from __future__ import annotations

import contextlib
import sys
import time

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's stack of decoder layers (the first ``...layers`` ModuleList: the language model's in a VLM)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList) and len(module):
            return module
    return None


@contextlib.contextmanager
def layer_progress(model: nn.Module, label: str, enabled: bool = True, stream=None):
    """Inside the block every finished layer's forward prints ``<label>: layer i/N, t s`` (``enabled``:
    rank 0 only); ``yield``s a callable that stops the reports early (e.g. once decoding starts)."""
    layers = decoder_layers(model) if enabled else None
    stream = stream or sys.stderr
    handles, started = [], time.perf_counter()

    def stop() -> None:
        while handles:
            handles.pop().remove()

    def report(index: int):
        def hook(module, inputs, output) -> None:
            print(
                f"{label}: layer {index + 1}/{len(layers)}, {time.perf_counter() - started:.1f} s",
                file=stream,
                flush=True,
            )
            if index + 1 == len(layers):
                stop()  # one forward reported; later ones (decode steps, training steps) stay quiet

        return hook

    if layers is not None:
        handles = [layer.register_forward_hook(report(i)) for i, layer in enumerate(layers)]
    try:
        yield stop
    finally:
        stop()
