"""Memory techniques a step may use, for the planner: fused loss, tiled MLP, lean norms, offload, K/V mode.

``Techniques`` is part of the :class:`hybridsp.planner.Workload`; every term it changes is
stated in :mod:`hybridsp.planner._memory`. ``ABLATION_ORDER`` is the order in which
``python -m hybridsp plan --ablation`` adds them (its rows are cumulative).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hybridsp._checks import check_positive

ABLATION_ORDER = ("fused_loss", "tiled_mlp", "activation_offload", "optimizer_offload")
KV_MODES = ("auto", "ring", "allgather")  # auto: the planner prices both per mesh (hybridsp.planner._kv_modes)


@dataclass(frozen=True)
class Techniques:
    """What the step does beyond plain Ulysses x ring attention with ZeRO.

    fused_loss: ``hybridsp.fused_cross_entropy`` (LM head + loss over chunks of ``loss_chunk``
        tokens; None: the library's default ``ceil(T h / V)``, at most 64 MiB of fp32 logits,
        ``hybridsp._formulas.default_chunk_size``; the ``[T, V]`` logits never exist).
        tiled_mlp: each MLP runs over tiles of ``mlp_tile`` tokens (None: the hidden size,
        Arctic/ALST's rule) with recomputation.
    lean_norms: ``hybridsp.apply_lean_norms``: each RMSNorm keeps x and one fp32 scale per row, not
        the normalised rows (not an ablation step: ``--lean-norms`` turns it on for every row).
    activation_offload: with activation checkpointing, the checkpointed layers' inputs live in
        host memory (``hybridsp.offload_activations``); the newest ``keep_last`` stay, and
        ``offload_in_flight`` more are on the device while copied (2 on CUDA: one each way;
        0 on CPU, where the copies are synchronous).
    spill_activations: with ``activation_offload``, the offloaded inputs go on to files on a local
        disk (``offload_activations(spill_dir=...)``): host memory holds only the writes in flight
        (at most ``hybridsp._formulas.SPILL_WRITES_IN_FLIGHT`` inputs' staging copies). The disk's bandwidth is not modelled (a
        local NVMe's few GB/s per GPU against the PCIe copies, which are timed as without it).
    optimizer_offload / param_offload: DeepSpeed ``offload_optimizer`` / ``offload_param`` to
        CPU (``ds_configs/cp8_offload.json``); the optimizer needs ZeRO >= 1, parameters ZeRO-3.
    kv_mode: how K/V blocks travel inside the ring group: ``"ring"``, ``"allgather"``, or
        ``"auto"`` (default): each mesh gets the faster of the two among those that fit
        (:mod:`hybridsp.planner._kv_modes` has both cost models).
    reduce_bucket: DeepSpeed's ``reduce_bucket_size`` (elements; 5e7 in ``ds_configs/``).
    prefetch_bucket: ZeRO-3's ``stage3_prefetch_bucket_size`` (elements; 5e7): parameters
        gathered ahead of the module that runs.
    head_chunks: G, the head groups each attention layer runs as (``hybrid_attn_func(head_chunks=)``):
        an int dividing the K/V heads a Ulysses rank holds, or ``"auto"``: the planner evaluates
        every G the mesh admits and keeps the fastest plan that fits (:mod:`hybridsp.planner._head_chunks`).
    collective_copies: full-size temporaries the communication backend makes of a collective's
        buffer: 0 for NCCL (in place), 1 for gloo (measured on CPU: its all-gather receives into
        a temporary, its reduce-scatter clones the input).
    """

    fused_loss: bool = False
    loss_chunk: int | None = None
    tiled_mlp: bool = False
    mlp_tile: int | None = None
    lean_norms: bool = False
    activation_offload: bool = False
    keep_last: int = 1
    offload_in_flight: int = 2
    spill_activations: bool = False
    optimizer_offload: bool = False
    param_offload: bool = False
    kv_mode: str = "auto"
    reduce_bucket: int = 50_000_000
    prefetch_bucket: int = 50_000_000
    collective_copies: int = 0
    head_chunks: int | str = 1

    def __post_init__(self):
        for name in ("reduce_bucket", "prefetch_bucket"):
            check_positive(getattr(self, name), f"Techniques.{name}", integer=True)
        for name in ("loss_chunk", "mlp_tile"):
            check_positive(getattr(self, name), f"Techniques.{name}", integer=True, or_none="")
        for name in ("keep_last", "offload_in_flight", "collective_copies"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Techniques.{name} must be an integer >= 0; got {value!r}")
        chunks = self.head_chunks
        if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
            raise ValueError(f"Techniques.head_chunks must be a positive integer or 'auto'; got {chunks!r}")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"unknown K/V mode {self.kv_mode!r}; choose one of {', '.join(KV_MODES)}")

    @property
    def names(self) -> tuple[str, ...]:
        """The ablation techniques switched on, in ``ABLATION_ORDER``."""
        return tuple(name for name in ABLATION_ORDER if getattr(self, name))

    def with_only(self, names) -> "Techniques":
        """A copy with exactly ``names`` (from ``ABLATION_ORDER``) on, the other settings kept."""
        unknown = sorted(set(names) - set(ABLATION_ORDER))
        if unknown:
            raise ValueError(f"unknown techniques {unknown}; choose from {', '.join(ABLATION_ORDER)}")
        switches: dict[str, Any] = {name: name in names for name in ABLATION_ORDER}  # bool fields, by name
        return replace(self, **switches)
