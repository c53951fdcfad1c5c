"""The ``"hybridsp"`` section of a DeepSpeed JSON config: its schema, checks and the cleaned config.

The config section (everything else in the file is plain DeepSpeed)::

    "hybridsp": {
        "ulysses": 4,                 # U: all-to-all degree (divides the query heads)
        "ring": 2,                    # R: ring-attention degree
        "order": "ulysses_inner",     # or "ring_inner" (which axis gets consecutive ranks)
        "layout": "zigzag",           # "contiguous", or "balanced" (by packed documents; token layout over the ring)
        "backend": "auto",            # local kernel: auto, torch, flash, reference
        "kv_comm": "ring",            # or "allgather" (how K/V travel inside the ring group)
        "kv_chunks": null,            # all-gather chunks per block (null: at most two blocks gathered)
        "head_chunks": 1,             # G head groups each attention call runs in turn (int >= 1 or "auto")
        "tensor": 1,                  # T: tensor-parallel degree (innermost; hybridsp.integrations.deepspeed._tensor)
        "tensor_sequence_parallel": false,  # Megatron-style SP inside the tensor group (1/T of the tokens)
        "generation": "plain"         # GRPO/RLOO completions: "plain" (the unswitched model on every context
                                      # rank) or "sharded" (hybridsp's generate: prompt and K/V cache sharded)
    }

The ``C = U * R`` context ranks of a replica hold the same weights and different tokens of
the same sequences; ``DP = world / C``. DeepSpeed's own ``sequence_parallel_size`` and
``data_parallel_size`` keys may be present; they must agree (``U * R`` and ``world / C``)
and are removed before ``deepspeed.initialize`` (Note [keys we own]). ``"enabled": "auto"``
in the ``bf16``/``fp16`` sections is resolved here (Note [auto precision]).

Note [keys we own]: ``deepspeed.initialize`` builds its own device mesh when the config holds
both ``sequence_parallel_size`` and ``data_parallel_size``, and that mesh overrides any mpu.
Both keys are validated and then removed; the mesh is ours.

Note [auto precision]: ``{"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}`` means:
bf16 on a CUDA device that supports it, else fp16 on CUDA, else fp32 (CPU). The one chosen
section is enabled and every other ``"auto"`` section disabled; explicit true/false stay.
DeepSpeed itself silently drops every ``"auto"`` value (runtime/config_utils.py), so the same
file handed to ``deepspeed.initialize`` directly would train in fp32 even on a GPU.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from hybridsp._types import GENERATION_MODES, BackendName, GenerationMode, HeadChunks, KVComm, LayoutName, MeshOrder
from hybridsp.integrations.deepspeed._compiling import without_compile_keys
from hybridsp.integrations.deepspeed._tensor import autotp_size
from hybridsp.kernels import BACKEND_NAMES
from hybridsp.mesh._hybrid_mesh import MeshShape

SECTION = "hybridsp"
SECTION_KEYS = (
    "ulysses",
    "ring",
    "order",
    "layout",
    "backend",
    "kv_comm",
    "kv_chunks",
    "head_chunks",
    "tensor",
    "tensor_sequence_parallel",
    "generation",
    "monitor",
)
OWNED_KEYS = (SECTION, "sequence_parallel_size", "data_parallel_size", "tensor_parallel")
PRECISIONS = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class HybridConfig:
    """The ``"hybridsp"`` section plus DeepSpeed's optional top-level size keys, validated."""

    ulysses: int = 1
    ring: int = 1
    order: MeshOrder = "ulysses_inner"
    layout: LayoutName = "zigzag"
    backend: BackendName = "auto"
    kv_comm: KVComm = "ring"
    kv_chunks: int | None = None
    head_chunks: HeadChunks = 1
    tensor: int = 1
    tensor_sequence_parallel: bool = False
    generation: GenerationMode = "plain"
    monitor: dict | None = None  # the "monitor" block (hybridsp.monitor.MonitorConfig), checked here
    sequence_parallel_size: int | None = None
    data_parallel_size: int | None = None

    def __post_init__(self):
        for name in ("ulysses", "ring", "tensor"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"{name} degree must be a positive integer; got {getattr(self, name)!r}")
        self._shape(self.context * self.tensor)  # checks the degrees and settings
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {self.backend!r}; choose one of {', '.join(BACKEND_NAMES)}")
        if self.generation not in GENERATION_MODES:
            raise ValueError(
                f"unknown generation {self.generation!r} in the {SECTION!r} section (how HybridGRPOTrainer / "
                f"HybridRLOOTrainer make completions); choose one of {', '.join(map(repr, GENERATION_MODES))}"
            )
        if self.monitor is not None:
            from hybridsp.monitor import MonitorConfig

            MonitorConfig.from_dict(self.monitor)  # ValueError naming the key or value
        for name in ("sequence_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if value is not None and not _positive_int(value):
                raise ValueError(
                    f"{name} must be a positive integer; got {value!r} ({type(value).__name__}): write it as a "
                    f"JSON number, e.g. {self.context if name == 'sequence_parallel_size' else 1}, or remove it"
                )
        if self.sequence_parallel_size is not None and self.sequence_parallel_size != self.context:
            raise ValueError(
                f"sequence_parallel_size={self.sequence_parallel_size} disagrees with the {SECTION} section: "
                f"ulysses={self.ulysses} x ring={self.ring} = {self.context} context ranks; set it to "
                f"{self.context} or remove it"
            )

    @property
    def context(self) -> int:
        """C = U * R, the ranks that share one replica's sequences."""
        return self.ulysses * self.ring

    @classmethod
    def from_ds_config(cls, config: dict, **overrides: Any) -> HybridConfig:
        """Read the section (absent: no sequence parallelism); keyword overrides that are not None win."""
        section = config.get(SECTION, {})
        if not isinstance(section, dict):
            raise ValueError(f"the {SECTION!r} config section must be an object; got {section!r}")
        unknown = sorted(set(section) - set(SECTION_KEYS))
        if unknown:
            raise ValueError(f"unknown keys {unknown} in the {SECTION!r} section; known: {', '.join(SECTION_KEYS)}")
        unknown = sorted(set(overrides) - set(SECTION_KEYS))
        if unknown:
            raise TypeError(f"unknown overrides {unknown}; known: {', '.join(SECTION_KEYS)}")
        section = {**section, **autotp_size(config, section)}
        return cls(
            **{**section, **{k: v for k, v in overrides.items() if v is not None}},
            sequence_parallel_size=config.get("sequence_parallel_size"),
            data_parallel_size=config.get("data_parallel_size"),
        )

    def _shape(self, world_size: int) -> MeshShape:
        return MeshShape(
            world_size,
            self.ulysses,
            self.ring,
            self.order,
            self.layout,
            self.kv_comm,
            self.kv_chunks,
            self.tensor,
            head_chunks=self.head_chunks,
        )

    def mesh_shape(self, world_size: int) -> MeshShape:
        """The mesh for ``world_size`` ranks; ValueError (no communication) when the sizes disagree."""
        shape = self._shape(world_size)
        if self.data_parallel_size is not None and self.data_parallel_size != shape.dp:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size} disagrees with world size {world_size} / "
                f"(ulysses={self.ulysses} x ring={self.ring}) = {shape.dp} replicas; set it to {shape.dp} or remove it"
            )
        return shape


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def load_config(config: dict | str | os.PathLike) -> dict:
    """A deep copy of a config dict, or the parsed JSON file at a path."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    with open(config, encoding="utf-8") as handle:
        return json.load(handle)


def auto_precision() -> str:
    """``"bf16"`` on a CUDA device that supports it, ``"fp16"`` on other CUDA devices, else ``"fp32"``."""
    if not torch.cuda.is_available():
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def resolve_precision(config: dict, precision: str | None = None) -> dict:
    """A copy of ``config`` with ``"enabled": "auto"`` in bf16/fp16 resolved (Note [auto precision]).

    ``precision`` (``bf16``, ``fp16`` or ``fp32``) defaults to :func:`auto_precision`.
    """
    precision = auto_precision() if precision is None else precision
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    config = copy.deepcopy(config)
    for name in ("bf16", "fp16"):
        section = config.get(name)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = name == precision
    sections = [config.get(name) for name in ("bf16", "fp16")]
    if all(isinstance(section, dict) and section.get("enabled") is True for section in sections):
        raise ValueError('bf16 and fp16 are both enabled; enable at most one (or set both to "auto")')
    return config


def deepspeed_config(config: dict, hybrid: HybridConfig, *, precision: str | None = None) -> dict:
    """The dict to hand ``deepspeed.initialize``: precision resolved, our keys removed (the ``"compile"``
    section's too: :mod:`hybridsp.integrations.deepspeed._compiling`), ZeRO-3 checked."""
    zero = config.get("zero_optimization", {})
    if hybrid.context > 1 and zero.get("stage", 0) == 3 and zero.get("reduce_scatter", True) is False:
        raise ValueError(
            f"zero_optimization.reduce_scatter=false with {hybrid.context} context ranks: DeepSpeed's ZeRO-3 then "
            f"divides gradients by DP for parameters that fit reduce_bucket_size and by DP x {hybrid.context} for "
            f"larger ones (Note [gradient scale] in hybridsp.integrations.deepspeed._engine); keep reduce_scatter true"
        )
    resolved = without_compile_keys(_torch_adam_on_cpu(resolve_precision(config, precision)))
    return {key: value for key, value in resolved.items() if key not in OWNED_KEYS}


def _torch_adam_on_cpu(config: dict) -> dict:
    """Without CUDA, a config Adam/AdamW runs as torch.optim (``"torch_adam": true``) unless the
    config says otherwise: DeepSpeed would otherwise JIT-compile CPUAdam/FusedAdam for minutes."""
    optimizer = config.get("optimizer")
    if torch.cuda.is_available() or not isinstance(optimizer, dict):
        return config
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    return config
