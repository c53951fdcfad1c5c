"""A readable console for the example: rank 0's progress bar and one summary, not 8 ranks' noise.

Everything here is scoped to the training run (a context manager restores the warning filters
and log levels on exit) and filters only what is known to be harmless:
- FutureWarnings/UserWarnings DeepSpeed triggers by calling torch.distributed collectives that
  torch 2.13 deprecates (``all_gather_into_tensor``, ``reduce_scatter_tensor``, the private
  ``_all_gather_base``/``_reduce_scatter_base``) and torch's
  ``TypedStorage`` deprecation inside its checkpoint code;
- DeepSpeed's INFO logging (engine and ZeRO set-up reports, config dumps); warnings and
  errors still show on rank 0;
- on ranks other than 0, every Python warning (rank 0 shows the same ones) and DeepSpeed's
  warnings, so nothing writes over rank 0's bar. Errors and tracebacks are never hidden.
DeepSpeed's "Setting accelerator to CPU" warning is avoided by naming the accelerator
(``DS_ACCELERATOR=cpu``) when no GPU is present, as DeepSpeed's own docs suggest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

HARMLESS_WARNINGS = (
    r".*torch\.distributed\._(all_gather_base|reduce_scatter_base).*",
    r"`torch\.distributed\.\w+` is deprecated\. Please use",  # torch 2.13 renames DeepSpeed still calls
    r".*TypedStorage is deprecated.*",
    r".*torch\.distributed\.reduce_op.*",
    r".*`torch\.cuda\.amp\..*` is deprecated.*",
)


def name_cpu_accelerator() -> None:
    """Tell DeepSpeed the accelerator on a machine without CUDA (before deepspeed is imported)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


@contextlib.contextmanager
def quiet_console(rank: int):
    """Filter known-harmless output for the duration of the block (see the module docstring)."""
    loggers = [logging.getLogger(name) for name in ("DeepSpeed", "deepspeed", "torch.distributed")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        if rank != 0:
            warnings.simplefilter("ignore")
        for pattern in HARMLESS_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"deepspeed(\..*)?$")
        for logger in loggers:
            logger.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
