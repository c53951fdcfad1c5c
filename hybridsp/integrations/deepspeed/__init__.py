"""DeepSpeed ZeRO (stages 0-3) composed with hybrid sequence parallelism: the public face.

    import hybridsp
    from hybridsp.integrations import deepspeed as hds

    engine, optimizer, mesh, undo = hds.initialize(model, "ds_configs/cp8.json", optimizer=opt)
    for full_batch in loader:                          # the same full batch on every context rank
        local = hybridsp.shard_batch(full_batch, mesh)
        logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"],
                        use_cache=False).logits
        loss = hybridsp.sharded_cross_entropy(logits, local["shift_labels"], mesh)
        engine.backward(loss)
        engine.step()

Names are imported on first use (DeepSpeed with them). Private modules: ``_config`` (the
``"hybridsp"`` section), ``_compiling``, ``_engine`` (the mpu, the mesh, the gradient scale),
``_entry`` (``initialize``), ``_tensor``, ``_checkpoint`` / ``_checkpoint_files``, ``_zero`` (ZeRO-3
parameters used outside a module call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridsp.integrations import lazy_exports

if TYPE_CHECKING:
    from hybridsp.integrations.deepspeed._checkpoint import (
        ResumeSource,
        convert_to_universal,
        latest_tag,
        plan_resume,
        save_checkpoint,
    )
    from hybridsp.integrations.deepspeed._config import (
        HybridConfig,
        auto_precision,
        deepspeed_config,
        load_config,
        resolve_precision,
    )
    from hybridsp.integrations.deepspeed._engine import (
        HybridEngine,
        HybridMPU,
        init_distributed,
        without_cpu_shm_comm_build,
    )
    from hybridsp.integrations.deepspeed._entry import initialize

_P = "hybridsp.integrations.deepspeed."
_EXPORTS = {
    "HybridConfig": _P + "_config",
    "auto_precision": _P + "_config",
    "deepspeed_config": _P + "_config",
    "load_config": _P + "_config",
    "resolve_precision": _P + "_config",
    "HybridEngine": _P + "_engine",
    "HybridMPU": _P + "_engine",
    "init_distributed": _P + "_engine",
    "without_cpu_shm_comm_build": _P + "_engine",
    "initialize": _P + "_entry",
    "ResumeSource": _P + "_checkpoint",
    "convert_to_universal": _P + "_checkpoint",
    "latest_tag": _P + "_checkpoint",
    "plan_resume": _P + "_checkpoint",
    "save_checkpoint": _P + "_checkpoint",
}
_INTERNAL = "an internal of the config reader, not a public name"
_DEPRECATED = {
    "OWNED_KEYS": (_P + "_config", _INTERNAL),
    "PRECISIONS": (_P + "_config", _INTERNAL),
    "SECTION": (_P + "_config", 'the section is always named "hybridsp"'),
    "SECTION_KEYS": (_P + "_config", "the keys are listed in docs/deepspeed-configs.md"),
    "build_mesh": (_P + "_engine", "initialize() builds the mesh; or call hybridsp.init_mesh"),
    "scale_gradients": (_P + "_engine", "initialize() and HybridSPTrainer scale the gradients themselves"),
}

__all__ = [
    "HybridConfig",
    "HybridEngine",
    "HybridMPU",
    "ResumeSource",
    "auto_precision",
    "convert_to_universal",
    "deepspeed_config",
    "init_distributed",
    "initialize",
    "latest_tag",
    "load_config",
    "plan_resume",
    "resolve_precision",
    "save_checkpoint",
    "without_cpu_shm_comm_build",
]

__getattr__ = lazy_exports(__name__, _EXPORTS, _DEPRECATED)
