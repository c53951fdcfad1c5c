"""Real Hugging Face checkpoints with DeepSpeed ZeRO: load partitioned, export loadable.

    model = load_pretrained("path/to/llama", ds_config)        # ZeRO-3: partitioned while it loads
    engine, _, mesh, _ = hybridsp.integrations.deepspeed.initialize(model, ds_config)
    ... train ...
    export_hf(engine, "out/hf")                                # save_pretrained-loadable directory

Note [loading under ZeRO-3]: building the full model on every rank first (``from_pretrained``
then ``deepspeed.initialize``) needs the whole model in host memory once per rank: 8 x 32 GB for
an 8B model in fp32 on one node. transformers' documented way is an ``HfDeepSpeedConfig`` alive
*before* ``from_pretrained``: transformers then constructs the model inside
``deepspeed.zero.Init`` (each parameter partitioned over the ranks as it is created) and
copies the checkpoint's tensors into the partitions one module at a time
(``_load_state_dict_into_zero3_model``). :func:`load_pretrained` does that with the DeepSpeed
config that :func:`hybridsp.integrations.deepspeed.initialize` will use (``"hybridsp"`` section
removed, ``"auto"`` precision resolved), in that config's precision (bf16 / fp16 / fp32), and
drops the ``HfDeepSpeedConfig`` again afterwards, so models built later in the same process are
not partitioned by surprise. ZeRO-3 partitions over all ranks (DP x C), the same set of ranks
the engine's mpu names. Stages 0-2 load the usual way, in the config's precision.

Note [export]: :func:`export_hf` gathers the full weights (ZeRO-3:
``engine._zero3_consolidated_16bit_state_dict()``, DeepSpeed's own gather behind
``save_16bit_model``, one layer at a time onto rank 0; stages 0-2: the module's state dict) and
rank 0 writes ``save_pretrained(directory, state_dict=...)``: config, generation config and
safetensors weights, loadable by ``from_pretrained`` without hybridsp or DeepSpeed. The
weights keep the training dtype (DeepSpeed's name says 16-bit; in fp32 training they are fp32).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from hybridsp.integrations.deepspeed import _config as ds_schema
from hybridsp.integrations.deepspeed import _engine as hds

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def config_dtype(ds_config: dict) -> torch.dtype:
    """The dtype a resolved DeepSpeed config trains in: bf16 / fp16 when enabled, else fp32."""
    for name in ("bf16", "fp16"):
        section = ds_config.get(name)
        if isinstance(section, dict) and section.get("enabled") is True:
            return DTYPES[name]
    return torch.float32


def load_pretrained(
    path: str | os.PathLike,
    config: dict | str | os.PathLike,
    *,
    precision: str | None = None,
    ulysses: int | None = None,
    ring: int | None = None,
    **from_pretrained_kwargs,
):
    """``AutoModelForCausalLM.from_pretrained(path)`` partitioned while it loads under ZeRO-3.

    Args:
        path: a local Hugging Face model directory (nothing is downloaded: ``local_files_only``).
        config: the DeepSpeed config (dict or JSON path) that ``initialize`` will get.
        precision: force the value of ``"auto"`` precision sections (as ``initialize`` does).
        ulysses, ring: the overrides ``initialize`` will get (validated here, before loading).
        from_pretrained_kwargs: passed on (``dtype`` defaults to the config's precision).

    Returns:
        the model; under ZeRO-3 every parameter is already a ZeRO-3 partition
        (``param.ds_tensor``), never materialised in full on any rank.
        Initialises torch.distributed through DeepSpeed when needed (a collective on all ranks).
    """
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    raw = ds_schema.load_config(config)
    hybrid = ds_schema.HybridConfig.from_ds_config(raw, ulysses=ulysses, ring=ring)
    ds_config = ds_schema.deepspeed_config(raw, hybrid, precision=precision)
    kwargs = {"local_files_only": True, "dtype": config_dtype(ds_config), **from_pretrained_kwargs}
    if ds_config.get("zero_optimization", {}).get("stage", 0) != 3:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    hds.init_distributed()  # adopts an existing process group
    hybrid.mesh_shape(dist.get_world_size())  # sizes checked before the collective load
    keep_alive = HfDeepSpeedConfig(partitioning_config(ds_config))  # noqa: F841 - transformers holds a weak reference
    try:
        with hds.without_cpu_shm_comm_build():
            return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    finally:
        unset_hf_deepspeed_config()


BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def partitioning_config(ds_config: dict) -> dict:
    """The config ZeRO-3 partitions a loading model by: ``ds_config`` with the Trainer's unfilled
    ``"auto"`` batch sizes and clipping resolved for loading (a micro batch of 1, no accumulation).

    A ``ds_configs/trainer/`` config leaves them ``"auto"`` for transformers to fill once the
    ``TrainingArguments`` exist; DeepSpeed's batch arithmetic cannot read ``"auto"``, and the values
    do not change how parameters are partitioned (``"auto"`` inside the ZeRO section DeepSpeed's
    config models drop by themselves)."""
    resolved_later = (*BATCH_KEYS, "gradient_clipping")
    config = {key: value for key, value in ds_config.items() if value != "auto" or key not in resolved_later}
    if not any(key in config for key in BATCH_KEYS):
        config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"] = 1, 1
    return config


def full_state_dict(engine) -> dict | None:
    """The unpartitioned state dict on rank 0 (None elsewhere); a collective under ZeRO-3."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    if dist.get_rank() != 0:
        return None
    return {name: tensor.detach().cpu() for name, tensor in engine.module.state_dict().items()}


def export_hf(engine, directory: str | os.PathLike) -> Path:
    """Write the trained model as a ``save_pretrained`` directory (Note [export]); all ranks call it.

    Returns the directory. Rank 0 writes; the other ranks wait for it (a barrier), so every rank
    may read the directory once this returns.
    """
    directory = Path(directory)
    state = full_state_dict(engine)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        engine.module.save_pretrained(directory, state_dict=state, safe_serialization=True)
    dist.barrier()
    return directory
