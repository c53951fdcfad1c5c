"""One evaluated candidate: is the mesh valid, what it costs, does it fit, and why."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, TypedDict

from hybridsp._formulas import heads_divisible
from hybridsp._types import MeshOrder
from hybridsp.layout._layouts import check_sequence_length
from hybridsp.planner._costs import CommVolume, Flops, comm_volume, expanded_kv_heads, flops_per_rank
from hybridsp.planner._head_chunks import head_chunk_choices, head_chunk_problem, resolved_head_chunks
from hybridsp.planner._kv_modes import best_of
from hybridsp.planner._memory import MemoryUse, memory_use
from hybridsp.planner._specs import GIB, ClusterSpec, MeshConfig, ModelSpec, Workload
from hybridsp.planner._timing import Timing, Topology, mesh_topology, step_timing

LAYOUT = "zigzag"


def format_seconds(seconds: float) -> str:
    """'450 us', '3.1 ms', '2.35 s'."""
    if seconds == 0:
        return "0 s"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def mesh_problems(model: ModelSpec, workload: Workload, cluster: ClusterSpec, config: MeshConfig) -> list[str]:
    """Why the mesh cannot run this model and sequence at all (empty when it can)."""
    problems = []
    if config.world_size != cluster.world_size:
        problems.append(
            f"DP={config.dp} x U={config.ulysses} x R={config.ring} = {config.world_size} ranks, "
            f"but the cluster has {cluster.world_size}"
        )
    if not heads_divisible(model.num_heads, config.ulysses):
        problems.append(f"heads {model.num_heads} not divisible by U={config.ulysses}")
    if model.linear is not None and model.linear_layers and model.linear.units % config.ulysses:
        problems.append(
            f"the linear layers' {model.linear.units} {'key heads' if model.linear.kind == 'delta_rule' else 'groups'}"
            f" are not divisible by U={config.ulysses}"
        )
    chunks = head_chunk_problem(model, workload, config) if heads_divisible(model.num_heads, config.ulysses) else None
    if chunks:
        problems.append(chunks)
    try:
        check_sequence_length(workload.seq_len, config.ring, config.ulysses, LAYOUT)
    except ValueError as error:
        problems.append(str(error))
    return problems


@dataclass(frozen=True)
class CandidatePlan:
    """A candidate mesh with its costs (``None`` when the mesh is invalid) and its reasons."""

    config: MeshConfig
    problems: tuple[str, ...]
    usable_bytes: float
    micro_batch: int = 1
    seq_len: int = 0
    flops: Flops | None = None
    comm: CommVolume | None = None
    memory: MemoryUse | None = None
    timing: Timing | None = None
    head_chunks: int = 1  # G, the head groups of each attention layer (hybridsp.planner._head_chunks)
    topology: Topology | None = None
    notes: tuple[str, ...] = ()
    host_usable_bytes: float = float("inf")  # this rank's share of its node's host memory

    @property
    def valid(self) -> bool:
        return not self.problems

    @property
    def fits(self) -> bool:
        return (
            self.valid and memory_of(self).total <= self.usable_bytes and memory_of(self).host <= self.host_usable_bytes
        )

    @property
    def step_s(self) -> float:
        if not self.valid:
            return float("inf")
        assert self.timing is not None  # evaluate() sets every cost of a valid plan
        return self.timing.step_s

    @property
    def seconds_per_sequence(self) -> float:
        """Step time over the sequences the step processes (DP replicas x micro-batch): the rank key."""
        return self.step_s / (self.config.dp * self.micro_batch)

    @property
    def tokens_per_s(self) -> float:
        return self.seq_len / self.seconds_per_sequence if self.valid else 0.0

    @property
    def ulysses_inside_node(self) -> bool:
        if not self.valid:
            return False
        assert self.topology is not None  # evaluate() sets every cost of a valid plan
        return not self.topology.ulysses_crosses_nodes

    def mfu(self, peak_flops: float) -> float:
        """Useful model FLOPs over peak (recomputation is not useful work)."""
        if not self.valid:
            return 0.0
        assert self.flops is not None  # evaluate() sets every cost of a valid plan
        return self.flops.model / (self.step_s * peak_flops)

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.problems + self.notes

    def summary(self) -> dict[str, Any]:
        """The headline numbers as plain JSON-able values."""
        row: dict[str, Any] = {
            "dp": self.config.dp,
            "ulysses": self.config.ulysses,
            "ring": self.config.ring,
            "zero_stage": self.config.zero_stage,
            "activation_checkpointing": self.config.checkpointing,
            "head_chunks": self.head_chunks,
            "valid": self.valid,
            "fits": self.fits,
            "reasons": list(self.reasons),
        }
        if self.valid:
            memory, topology, comm = memory_of(self), self.topology, self.comm
            assert topology is not None and comm is not None  # evaluate() sets every cost of a valid plan
            row.update(
                step_s=self.step_s,
                seconds_per_sequence=self.seconds_per_sequence,
                tokens_per_s=self.tokens_per_s,
                memory_gib=memory.total / GIB,
                usable_gib=self.usable_bytes / GIB,
                host_gib=memory.host / GIB,
                peak_phase=memory.peak_phase,
                all_to_all_crosses_nodes=topology.ulysses_crosses_nodes,
                ring_crosses_nodes=topology.ring_crosses_nodes,
                kv_comm=comm.kv_comm,
            )
        return row

    def to_dict(self) -> dict[str, Any]:
        """Everything: the summary plus FLOPs, bytes, memory and timing breakdowns."""
        row = self.summary()
        if self.valid:
            flops, comm, memory, timing = self.flops, self.comm, memory_of(self), self.timing
            assert flops is not None and comm is not None and timing is not None  # set for every valid plan
            row.update(
                flops=asdict(flops),
                bytes_per_step={"all_to_all": comm.all_to_all, "ring": comm.ring_total},
                comm=asdict(comm),
                memory={
                    **asdict(memory),
                    "phases": dict(memory.phases),
                    "total": memory.total,
                    "host": memory.host,
                    "host_usable": self.host_usable_bytes,
                },
                timing={**asdict(timing), "step_s": self.step_s, "exposed_comm_s": timing.exposed_comm_s},
            )
        return row


def memory_of(plan: CandidatePlan) -> MemoryUse:
    """The memory a valid plan needs (:func:`evaluate` sets every cost of a plan whose mesh is valid)."""
    assert plan.memory is not None, "an invalid mesh has no memory use"
    return plan.memory


class _PlanBase(TypedDict):
    """What every :class:`CandidatePlan` of one evaluation shares, valid or not."""

    config: MeshConfig
    usable_bytes: float
    micro_batch: int
    seq_len: int
    host_usable_bytes: float


def _all_to_all_note(model: ModelSpec, config: MeshConfig, topology: Topology, timing: Timing) -> list[str]:
    if config.ulysses == 1:
        return []
    notes = []
    per_node = topology.gpus_per_node
    if topology.ulysses_crosses_nodes:
        why = (
            f"U={config.ulysses} > {per_node} GPUs per node"
            if config.ulysses > per_node
            else (f"U={config.ulysses} does not divide {per_node} GPUs per node")
        )
        notes.append(f"all-to-all crosses nodes ({why}): {format_seconds(timing.all_to_all_s)} exposed per step")
    else:
        notes.append(f"all-to-all inside a node: {format_seconds(timing.all_to_all_s)} exposed per step")
    repeats = expanded_kv_heads(model, config.ulysses) // model.num_kv_heads
    if repeats > 1:
        notes.append(f"GQA: {model.num_kv_heads} K/V heads repeated {repeats}x for U={config.ulysses}")
    return notes


def _ring_note(timing: Timing) -> list[str]:
    ring = timing.ring
    if ring is None:
        return []
    where = "crosses nodes" if ring.link == "inter" else "inside a node"
    what = "ring" if ring.mode == "ring" else "K/V all-gather"
    if not ring.forward_hidden:
        return [
            f"{what} ({where}) transfer {format_seconds(ring.forward_transfer_s)} > compute "
            f"{format_seconds(ring.forward_compute_s)} per step: exposed {format_seconds(ring.exposed_s)} per step"
        ]
    if not ring.backward_hidden:
        return [
            f"{what} ({where}) backward transfer {format_seconds(ring.backward_transfer_s)} > compute "
            f"{format_seconds(ring.backward_compute_s)} per step: exposed "
            f"{format_seconds(ring.exposed_s)} per step"
        ]
    tail = f" except the last dK/dV hop home ({format_seconds(ring.exposed_s)})" if ring.exposed_s > 0 else ""
    return [
        f"{what} ({where}) transfer {format_seconds(ring.forward_transfer_s)} <= compute "
        f"{format_seconds(ring.forward_compute_s)} per {'step' if ring.mode == 'ring' else 'chunk'}: hidden{tail}"
    ]


def _memory_note(memory: MemoryUse, usable: float, host_usable: float = float("inf")) -> str:
    need, have = memory.total / GIB, usable / GIB
    if memory.total > usable:
        note = f"needs {need:.1f} GiB > {have:.1f} GiB usable"
    else:
        note = f"needs {need:.1f} GiB of {have:.1f} GiB usable"
    note += f" (peak: {memory.peak_phase})"
    if memory.host:
        relation = ">" if memory.host > host_usable else "of"
        note += f"; host {memory.host / GIB:.1f} GiB {relation} its {host_usable / GIB:.0f} GiB share"
    return note


def _notes(
    model: ModelSpec,
    config: MeshConfig,
    topology: Topology,
    timing: Timing,
    memory: MemoryUse,
    usable: float,
    host_usable: float = float("inf"),
) -> tuple[str, ...]:
    notes = [_memory_note(memory, usable, host_usable)]
    notes += _all_to_all_note(model, config, topology, timing)
    notes += _ring_note(timing)
    if timing.zero_exposed_s > 0:
        notes.append(
            f"ZeRO-{config.zero_stage}: {format_seconds(timing.zero_exposed_s)} of its "
            f"{format_seconds(timing.zero_comm_s)} traffic exposed per step"
        )
    if timing.host_traffic_bytes:
        notes.append(
            f"offload: {timing.host_traffic_bytes / GIB:.1f} GiB over PCIe per step, "
            f"{format_seconds(timing.offload_s)} exposed (CPU optimizer step included)"
        )
    return tuple(notes)


def evaluate(
    model: ModelSpec,
    workload: Workload,
    cluster: ClusterSpec,
    config: MeshConfig,
    topology: Topology | None = None,
    order: MeshOrder = "ulysses_inner",
) -> CandidatePlan:
    """Validate ``config`` and, when valid, compute its FLOPs, bytes, memory, timing and notes.

    ``kv_mode="auto"`` evaluates the ring and the all-gather transport and keeps the faster
    one that fits (:func:`hybridsp.planner._kv_modes.best_of`).
    """
    if workload.techniques.head_chunks == "auto":
        choices = (
            head_chunk_choices(model, config.ulysses) if heads_divisible(model.num_heads, config.ulysses) else (1,)
        )
        each = [replace(workload, techniques=replace(workload.techniques, head_chunks=g)) for g in choices]
        return best_of([evaluate(model, w, cluster, config, topology, order) for w in each])
    if workload.techniques.kv_mode == "auto":
        modes = [
            replace(workload, techniques=replace(workload.techniques, kv_mode=mode)) for mode in ("ring", "allgather")
        ]
        return best_of([evaluate(model, w, cluster, config, topology, order) for w in modes])
    problems = tuple(mesh_problems(model, workload, cluster, config))
    base = _PlanBase(
        config=config,
        usable_bytes=cluster.usable_bytes,
        micro_batch=workload.micro_batch,
        seq_len=workload.seq_len,
        host_usable_bytes=cluster.host_bytes_per_gpu,
    )
    if problems:
        return CandidatePlan(problems=problems, **base)
    topology = topology or mesh_topology(config, cluster.gpus_per_node, order)
    flops = flops_per_rank(model, workload, config)
    memory = memory_use(model, workload, config)
    timing = step_timing(model, workload, config, topology, cluster, flops)
    notes = _notes(model, config, topology, timing, memory, cluster.usable_bytes, cluster.host_bytes_per_gpu)
    return CandidatePlan(
        problems=(),
        flops=flops,
        comm=comm_volume(model, workload, config),
        memory=memory,
        timing=timing,
        topology=topology,
        notes=notes,
        head_chunks=resolved_head_chunks(model, workload, config),
        **base,
    )
