"""``plan_degrees``: Ulysses and ring degrees from what a launcher knows; the rule lives in
:mod:`hybridsp.degrees` (what ``init_mesh("auto")`` uses), this adds the cost-model choice."""

from __future__ import annotations

from hybridsp.degrees import check_launch, largest_inside_node, ulysses_candidates
from hybridsp.planner.plans import LAYOUT, evaluate
from hybridsp.planner.specs import ClusterSpec, MeshConfig, ModelSpec, Workload


def _by_cost(candidates: list[int], context: int, model: ModelSpec, workload: Workload, cluster: ClusterSpec,
             tie_tolerance: float) -> int:
    """The candidate with the least modelled step time (only attention differs at fixed C);
    ties within ``tie_tolerance`` go to a larger U inside a node."""
    dp = cluster.world_size // context
    plans = [evaluate(model, workload, cluster, MeshConfig(dp, u, context // u)) for u in candidates]
    best = min(plan.step_s for plan in plans)
    tied = [plan for plan in plans if plan.step_s <= best * (1 + tie_tolerance)]
    chosen = min(tied, key=lambda p: (not p.ulysses_inside_node, -p.config.ulysses))
    return chosen.config.ulysses


def plan_degrees(
    world_size: int, local_world_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    seq_len: int | None = None, *, context_size: int | None = None, ulysses: int | None = None,
    ring: int | None = None, micro_batch: int = 1, cluster: ClusterSpec | None = None,
    model: ModelSpec | None = None, tie_tolerance: float = 0.02,
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
                num_heads, num_kv_heads, head_dim):
            raise ValueError(
                f"model {model.name} has heads/kv heads/head dim {model.num_heads}/{model.num_kv_heads}/"
                f"{model.head_dim}, not {num_heads}/{num_kv_heads}/{head_dim}"
            )
        model = model or ModelSpec(num_heads, num_kv_heads, head_dim, num_heads * head_dim, 4 * num_heads * head_dim,
                                   1, 1, name="attention-only")
        workload = Workload(seq_len, micro_batch)
        chosen = _by_cost(candidates, context, model, workload, cluster, tie_tolerance)
        return chosen, context // chosen
    chosen = largest_inside_node(candidates, local_world_size)
    return chosen, context // chosen
