"""Enumerate every (DP, U, R) x ZeRO stage x checkpointing, rank them, pick one; longest context;
``plan_degrees``: Ulysses and ring degrees from what a launcher knows (the rule lives in
:mod:`hybridsp.mesh._auto_degrees`, what ``init_mesh("auto")`` uses; this adds the cost-model choice)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from hybridsp._checks import check_positive
from hybridsp._formulas import heads_divisible
from hybridsp._types import MeshOrder
from hybridsp.mesh._auto_degrees import check_launch, divisors, largest_inside_node, ulysses_candidates
from hybridsp.planner._candidates import LAYOUT, CandidatePlan, evaluate, memory_of, mesh_problems
from hybridsp.planner._memory import memory_use
from hybridsp.planner._specs import ClusterSpec, MeshConfig, ModelSpec, Workload
from hybridsp.planner._techniques import Techniques
from hybridsp.planner._timing import mesh_topology

MAX_SEQ_LEN = 2**40  # the longest-context search stops doubling here


@dataclass(frozen=True)
class SearchSpace:
    """Which candidates to consider. ``None`` degrees are free; ``tie_tolerance`` is the
    relative slack within which plans count as equally fast."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    checkpointing: tuple[bool, ...] = (False, True)
    dp: int | None = None
    ulysses: int | None = None
    ring: int | None = None
    order: MeshOrder = "ulysses_inner"
    tie_tolerance: float = 0.02
    headroom: float = 0.10

    def __post_init__(self):
        if not self.zero_stages or not set(self.zero_stages) <= {0, 1, 2, 3}:
            raise ValueError(f"ZeRO stages must be a non-empty subset of 0, 1, 2, 3; got {self.zero_stages!r}")
        if not self.checkpointing or not set(self.checkpointing) <= {False, True}:
            raise ValueError(f"checkpointing must be a non-empty subset of (False, True); got {self.checkpointing!r}")
        for name in ("dp", "ulysses", "ring"):
            check_positive(getattr(self, name), name, integer=True, or_none="")
        if self.tie_tolerance < 0:
            raise ValueError(f"tie_tolerance must be >= 0; got {self.tie_tolerance}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom is a fraction of usable memory in [0, 1); got {self.headroom}")

    def admits(self, dp: int, ulysses: int, ring: int) -> bool:
        pairs = ((self.dp, dp), (self.ulysses, ulysses), (self.ring, ring))
        return all(want is None or want == got for want, got in pairs)


def degree_triples(world_size: int) -> list[tuple[int, int, int]]:
    """Every (DP, U, R) with DP x U x R = world_size."""
    return [(world_size // (u * r), u, r) for u in divisors(world_size) for r in divisors(world_size // u)]


def _configs(workload: Workload, space: SearchSpace, dp: int, u: int, r: int) -> list[MeshConfig]:
    """The stage x checkpointing candidates of one mesh. Forward-only: no recompute, and stages
    1-2 (which partition only gradients and optimizer states) collapse into stage 0."""
    stages, checkpointing = space.zero_stages, space.checkpointing
    if workload.forward_only:
        stages = tuple(stage for stage in stages if stage in (0, 3)) or stages
        checkpointing = (False,)
    return [MeshConfig(dp, u, r, stage, ckpt) for stage in stages for ckpt in checkpointing]


def evaluate_all(model: ModelSpec, workload: Workload, cluster: ClusterSpec, space: SearchSpace) -> list[CandidatePlan]:
    """Every candidate of ``space``; an invalid mesh appears once (its first stage) with its problems."""
    plans = []
    for dp, u, r in degree_triples(cluster.world_size):
        if not space.admits(dp, u, r):
            continue
        configs = _configs(workload, space, dp, u, r)
        if mesh_problems(model, workload, cluster, configs[0]):
            plans.append(evaluate(model, workload, cluster, configs[0]))
            continue
        topology = mesh_topology(configs[0], cluster.gpus_per_node, space.order)
        plans += [evaluate(model, workload, cluster, config, topology, space.order) for config in configs]
    return plans


def _preference(plan: CandidatePlan, headroom: float = 0.0) -> tuple:
    """Among equally fast plans: Ulysses inside a node, larger U, ``headroom`` of memory left
    free, then the faster, then lower ZeRO stage and no recompute."""
    cramped = memory_of(plan).total > (1 - headroom) * plan.usable_bytes
    return (
        not plan.ulysses_inside_node,
        -plan.config.ulysses,
        cramped,
        plan.seconds_per_sequence,
        plan.config.zero_stage,
        plan.config.checkpointing,
    )


def recommend(plans: list[CandidatePlan], tie_tolerance: float = 0.02, headroom: float = 0.10) -> CandidatePlan | None:
    """The fastest plan that fits (per sequence); ties within ``tie_tolerance`` go to :func:`_preference`."""
    fitting = [plan for plan in plans if plan.fits]
    if not fitting:
        return None
    best = min(plan.seconds_per_sequence for plan in fitting)
    tied = [plan for plan in fitting if plan.seconds_per_sequence <= best * (1 + tie_tolerance)]
    return min(tied, key=lambda plan: _preference(plan, headroom))


@dataclass(frozen=True)
class PlanResult:
    """Ranked plans: the recommendation first, then fitting plans by speed, then plans that do
    not fit by the memory they need; ``rejected`` holds the invalid meshes."""

    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    recommended: CandidatePlan | None
    ranked: tuple[CandidatePlan, ...]
    rejected: tuple[CandidatePlan, ...] = field(default=())

    def to_dict(self) -> dict:
        return {
            "model": asdict(self.model),
            "cluster": asdict(self.cluster),
            "workload": asdict(self.workload),
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "ranked": [plan.summary() for plan in self.ranked],
            "rejected": [plan.summary() for plan in self.rejected],
        }


def _ranked(plans: list[CandidatePlan], recommended: CandidatePlan | None) -> tuple[CandidatePlan, ...]:
    """The recommendation, the other fitting plans by speed, then the rest by memory needed."""
    fitting = sorted((p for p in plans if p.fits and p is not recommended), key=_preference_by_speed)
    too_big = sorted(
        (p for p in plans if p.valid and not p.fits), key=lambda p: (memory_of(p).total, p.seconds_per_sequence)
    )
    return (*([recommended] if recommended else []), *fitting, *too_big)


def _preference_by_speed(plan: CandidatePlan) -> tuple:
    return (plan.seconds_per_sequence, _preference(plan))


def plan(model: ModelSpec, workload: Workload, cluster: ClusterSpec, space: SearchSpace | None = None) -> PlanResult:
    """Evaluate every candidate, recommend the fastest that fits, and rank the rest."""
    space = space or SearchSpace()
    plans = evaluate_all(model, workload, cluster, space)
    best = recommend(plans, space.tie_tolerance, space.headroom)
    rejected = tuple(p for p in plans if not p.valid)
    return PlanResult(model, cluster, workload, best, _ranked(plans, best), rejected)


# ----------------------------------------------------------------------------- longest context


@dataclass(frozen=True)
class LongestContext:
    """The longest sequence (a multiple of ``granularity``) some plan fits, and the plans there."""

    seq_len: int
    granularity: int
    result: PlanResult | None

    def to_dict(self) -> dict:
        return {
            "seq_len": self.seq_len,
            "granularity": self.granularity,
            "plan": self.result.to_dict() if self.result else None,
        }


def _sequence_step(granularity: int, ulysses: int, ring: int) -> int:
    """Smallest multiple of ``granularity`` the zigzag layout can split: lcm(g, R * lcm(2, U))."""
    return math.lcm(granularity, ring * math.lcm(2, ulysses))


def _fits(model: ModelSpec, workload: Workload, cluster: ClusterSpec, config: MeshConfig, memory_of=memory_use) -> bool:
    if mesh_problems(model, workload, cluster, config):
        return False
    memory = memory_of(model, workload, config)
    return memory.total <= cluster.usable_bytes and memory.host <= cluster.host_bytes_per_gpu


def _longest_for(
    model: ModelSpec, workload: Workload, cluster: ClusterSpec, config: MeshConfig, step: int, memory_of=memory_use
) -> int:
    """Largest multiple of ``step`` that fits with ``config`` (memory grows with S), or 0."""

    def fits(k: int) -> bool:
        return _fits(model, replace(workload, seq_len=k * step), cluster, config, memory_of)

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        if high * step > MAX_SEQ_LEN:
            return high * step
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * step


def longest_context(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    granularity: int = 1024,
    micro_batch: int = 1,
    forward_only: bool = False,
    chunked_loss: bool = False,
    dtype_bytes: int = 2,
    causal: bool = True,
    space: SearchSpace | None = None,
    techniques: Techniques | None = None,
    memory_of=memory_use,
) -> LongestContext:
    """The largest ``seq_len`` (a multiple of ``granularity``) that fits in memory (device and
    host) under some plan, with the ranked plans at that length (their recommendation fits by
    construction). ``techniques``: fused loss, tiled MLP, offload (default: none). ``memory_of``:
    the memory model the fit test uses (default :func:`~hybridsp.planner._memory.memory_use`; a
    what-if passes a variant; the ranked plans always use the planner's own)."""
    if not isinstance(granularity, int) or granularity < 1:
        raise ValueError(f"granularity must be a positive integer; got {granularity!r}")
    space = space or SearchSpace()
    workload = Workload(
        granularity, micro_batch, forward_only, causal, dtype_bytes, chunked_loss, techniques or Techniques()
    )
    longest = 0
    for dp, u, r in degree_triples(cluster.world_size):
        if not space.admits(dp, u, r) or not heads_divisible(model.num_heads, u):
            continue
        for config in _configs(workload, space, dp, u, r):
            step = _sequence_step(granularity, u, r)
            longest = max(longest, _longest_for(model, workload, cluster, config, step, memory_of))
    if longest == 0:
        return LongestContext(0, granularity, None)
    return LongestContext(longest, granularity, plan(model, replace(workload, seq_len=longest), cluster, space))


def _by_cost(
    candidates: list[int],
    context: int,
    model: ModelSpec,
    workload: Workload,
    cluster: ClusterSpec,
    tie_tolerance: float,
) -> int:
    """The candidate with the least modelled step time (only attention differs at fixed C);
    ties within ``tie_tolerance`` go to a larger U inside a node."""
    dp = cluster.world_size // context
    plans = [evaluate(model, workload, cluster, MeshConfig(dp, u, context // u)) for u in candidates]
    best = min(plan.step_s for plan in plans)
    tied = [plan for plan in plans if plan.step_s <= best * (1 + tie_tolerance)]
    chosen = min(tied, key=lambda p: (not p.ulysses_inside_node, -p.config.ulysses))
    return chosen.config.ulysses


def plan_degrees(
    world_size: int,
    local_world_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int | None = None,
    *,
    context_size: int | None = None,
    ulysses: int | None = None,
    ring: int | None = None,
    micro_batch: int = 1,
    cluster: ClusterSpec | None = None,
    model: ModelSpec | None = None,
    tie_tolerance: float = 0.02,
) -> tuple[int, int]:
    """``(ulysses, ring)`` for a context group of ``context_size`` ranks (default: the whole world).

    Rule (nothing else known): the largest U that divides the query heads, the context size
    and ``local_world_size`` (so a Ulysses group never leaves a node), the rest ring. With
    ``seq_len``, degrees the zigzag layout cannot split are skipped. With ``seq_len`` and a
    ``cluster`` (whose shape must match), the cost model chooses among all valid U, ties
    going to the largest U inside a node; ``model`` refines it further (otherwise an
    attention-only model of the given shape is used). Fix one degree by passing it
    (``ulysses=4``) to get the other. Raises ValueError, quoting the numbers, when nothing fits.
    """
    context = world_size if context_size is None else context_size
    check_launch(world_size, local_world_size, context, num_heads, num_kv_heads, head_dim, micro_batch)
    candidates = ulysses_candidates(context, num_heads, seq_len, ulysses, ring, LAYOUT)
    if seq_len is not None and cluster is not None:
        if (cluster.world_size, cluster.gpus_per_node) != (world_size, local_world_size):
            raise ValueError(
                f"cluster has {cluster.nodes} x {cluster.gpus_per_node} ranks but the launcher reports "
                f"world {world_size} with {local_world_size} per node"
            )
        if model is not None and (model.num_heads, model.num_kv_heads, model.head_dim) != (
            num_heads,
            num_kv_heads,
            head_dim,
        ):
            raise ValueError(
                f"model {model.name} has heads/kv heads/head dim {model.num_heads}/{model.num_kv_heads}/"
                f"{model.head_dim}, not {num_heads}/{num_kv_heads}/{head_dim}"
            )
        model = model or ModelSpec(
            num_heads,
            num_kv_heads,
            head_dim,
            num_heads * head_dim,
            4 * num_heads * head_dim,
            1,
            1,
            name="attention-only",
        )
        workload = Workload(seq_len, micro_batch)
        chosen = _by_cost(candidates, context, model, workload, cluster, tie_tolerance)
        return chosen, context // chosen
    chosen = largest_inside_node(candidates, local_world_size)
    return chosen, context // chosen
