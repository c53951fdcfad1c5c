"""FSDP asked of :class:`~hybridsp.integrations.transformers._trainer.HybridSPTrainer`: refused in words, never run as DDP.

Note [FSDP under the Trainer]: accelerate keeps an FSDP plugin only for GPU-like distributed types, so
on CPU ``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})`` (or ``accelerate launch`` with
``distributed_type: FSDP``) silently trains as DDP, every parameter whole on every rank; on a GPU
accelerate's FSDP2 would shard over its own mesh and average gradients over all ranks, which is not
the hybrid's gradient (Note [gradient scale under FSDP2] in :mod:`hybridsp.integrations.fsdp._shard`).
Until the Trainer shards with FSDP2 over the hybrid mesh itself, :func:`refuse_fsdp` raises a
ValueError when FSDP is asked for, before any collective. FSDP2 with the hybrid runs today through
:func:`hybridsp.integrations.fsdp.fully_shard_model` (``examples/fsdp2_torchrun.py``); the Trainer
shards with DeepSpeed ZeRO-3 (docs/fsdp2.md).
"""

from __future__ import annotations

import os


def fsdp_requested(args) -> str | None:
    """How FSDP was asked for (``TrainingArguments.fsdp`` or accelerate's launcher), or None."""
    if getattr(args, "fsdp", None):
        version = (getattr(args, "fsdp_config", None) or {}).get("version", 1)
        return f"TrainingArguments(fsdp={args.fsdp!r}) with FSDP version {version}"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return f"accelerate's distributed_type FSDP (FSDP_VERSION={os.environ.get('FSDP_VERSION', '1')})"
    return None


def refuse_fsdp(args) -> None:
    """ValueError when FSDP is asked for (Note [FSDP under the Trainer]); no communication."""
    asked = fsdp_requested(args)
    if asked is not None:
        raise ValueError(
            f"HybridSPTrainer does not shard with FSDP yet ({asked}): it would train as DDP or average the context "
            "ranks' partial gradients wrongly. Shard with DeepSpeed ZeRO-3 (the 'hybridsp' section), or use "
            "hybridsp.integrations.fsdp.fully_shard_model in your own loop (examples/fsdp2_torchrun.py; docs/fsdp2.md)"
        )
