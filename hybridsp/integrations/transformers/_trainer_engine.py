"""DeepSpeed's engine inside :class:`~hybridsp.integrations.transformers._trainer.HybridSPTrainer`: the config
it accepts, the keys it owns, and the ``deepspeed.initialize`` it intercepts.

Note [intercepting deepspeed.initialize]: accelerate builds the engine inside
``Accelerator._prepare_deepspeed`` with ``deepspeed.initialize(model=..., config_params=...)``
and passes an ``mpu`` only for its own Ulysses backend. The narrowest point at which ours can
be added is that call: :meth:`HybridSPMixin.create_accelerator_and_postprocess` wraps this
Trainer's ``accelerator.prepare`` so that, *for the duration of each prepare call only*,
``deepspeed.initialize`` is a wrapper that passes :class:`~hybridsp.integrations.deepspeed._engine.HybridMPU`,
sets ``train_batch_size`` to micro x accumulation x DP (HF's ``"auto"`` counts all ranks),
selects torch's Adam on CPU, skips the CPU shm-comm build, and adds the ZeRO-3 hooks (one
set per model: an evaluation engine followed by a training engine does not double them);
the original function is restored when prepare returns (also on error). Nothing else global
is touched. Our keys (``hybridsp``, ``sequence_parallel_size``, ``data_parallel_size``) are
read when the accelerator is created and then removed from the config copies that the
Trainer and accelerate hold: accelerate refuses any ``"auto"`` it cannot fill (``"backend":
"auto"``), and DeepSpeed must not build its own mesh from the size keys. On CPU,
``TrainingArguments(use_cpu=True)`` is needed: accelerate starts several CPU processes only
then (it then leaves ``deepspeed.comm`` to ``deepspeed.initialize``, which is all we need).

Note [no tensor parallelism]: the Trainer builds its optimizer, data shards, loss and evaluation
gathers for the ``DP x C`` ranks of an unsplit model. With ``"tensor": T > 1`` in the ``"hybridsp"``
section (or DeepSpeed's ``"tensor_parallel": {"autotp_size": T}``) it would train the whole weights on
every tensor rank, the T ranks of a slot doing identical work, and say nothing; so
:func:`refuse_tensor_parallel` raises a ValueError when the section is read (before the mesh, so
before any collective). Tensor parallelism trains through
:func:`hybridsp.integrations.deepspeed.initialize` (``examples/train.py --tensor T``), which splits
the model before DeepSpeed sees it (docs/tensor-parallel.md).
"""

from __future__ import annotations

import contextlib

from hybridsp.integrations.deepspeed import _config as ds_schema
from hybridsp.integrations.deepspeed import _engine as hds
from hybridsp.integrations.transformers._fsdp2_trainer import prepare_sharded
from hybridsp.mesh._hybrid_mesh import HybridMesh


def refuse_tensor_parallel(hybrid: ds_schema.HybridConfig) -> None:
    """ValueError for ``tensor > 1`` (Note [no tensor parallelism]); no communication."""
    if hybrid.tensor > 1:
        raise ValueError(
            f"HybridSPTrainer has no tensor parallelism: with tensor={hybrid.tensor} it would train the unsplit "
            f"weights on all {hybrid.tensor} tensor ranks doing identical work. For tensor parallelism use "
            f"hybridsp.integrations.deepspeed.initialize (examples/train.py --tensor {hybrid.tensor}; see "
            f'docs/tensor-parallel.md), or set "tensor": 1 and remove "tensor_parallel" from the DeepSpeed config'
        )


def hybrid_config(args, overrides: dict) -> ds_schema.HybridConfig:
    """The validated section of ``args``' DeepSpeed config (none without DeepSpeed) with ``overrides``;
    ValueError for tensor parallelism (Note [no tensor parallelism])."""
    deepspeed = getattr(args, "hf_deepspeed_config", None) if args.deepspeed else None
    hybrid = ds_schema.HybridConfig.from_ds_config(deepspeed.config if deepspeed else {}, **overrides)
    refuse_tensor_parallel(hybrid)
    return hybrid


def prepare_with_mesh(prepare, trainer, *args, **kwargs):
    """``accelerator.prepare`` with our ``deepspeed.initialize`` in place (Note [intercepting ...])."""
    if trainer._hybridsp_fsdp2 is not None:  # Note [the Trainer's FSDP2 path]: no DDP around the shards
        return prepare_sharded(prepare, trainer.accelerator, trainer.model, *args, **kwargs)
    if not trainer.is_deepspeed_enabled:
        return prepare(*args, **kwargs)
    with _deepspeed_initialize_with_mesh(trainer):
        return prepare(*args, **kwargs)


@contextlib.contextmanager
def _deepspeed_initialize_with_mesh(trainer):
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        mesh, hybrid = trainer.hybrid_mesh, trainer.hybrid_config
        if kwargs.get("mpu") is not None:
            raise ValueError(
                "HybridSPTrainer passes DeepSpeed its own mpu; do not combine it with accelerate's "
                "ParallelismConfig(sp_backend='deepspeed') (see the migration note in docs/hf-trainer.md)"
            )
        key = "config_params" if "config_params" in kwargs else "config"
        kwargs[key] = engine_config(kwargs[key], hybrid, mesh)
        kwargs["mpu"] = hds.HybridMPU(mesh)
        with hds.without_cpu_shm_comm_build():
            result = original(*args, **kwargs)
        engine = result[0]
        if engine.zero_optimization_stage() == 3:  # Note [gradient scale here]
            trainer._scale_gradients(engine.module)
        return result

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def remove_owned_keys(plugin, args) -> None:
    """Drop our keys from every copy of the config accelerate and the Trainer hold.

    accelerate refuses any ``"auto"`` it cannot fill (``"backend": "auto"`` in our section),
    and DeepSpeed must not see the size keys (Note [keys we own] in
    :mod:`hybridsp.integrations.deepspeed._engine`); they were read and validated before this.
    """
    configs = {id(c): c for c in (plugin.deepspeed_config, plugin.hf_ds_config.config, args.hf_deepspeed_config.config)}
    for config in configs.values():
        for key in ds_schema.OWNED_KEYS:
            config.pop(key, None)


def engine_config(config: dict, hybrid: ds_schema.HybridConfig, mesh: HybridMesh) -> dict:
    """The config DeepSpeed sees: our keys removed, torch Adam on CPU, the batch of DP replicas."""
    cleaned = ds_schema.deepspeed_config(ds_schema.load_config(config), hybrid)
    micro = cleaned.get("train_micro_batch_size_per_gpu")
    accumulation = cleaned.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(accumulation, int):
        cleaned["train_batch_size"] = micro * accumulation * mesh.dp
    return cleaned
