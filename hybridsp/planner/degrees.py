"""``plan_degrees``: Ulysses and ring degrees from what a launcher knows, for ``init_mesh("auto")``."""

from __future__ import annotations

from hybridsp.layout import check_sequence_length
from hybridsp.planner.plans import LAYOUT, evaluate
from hybridsp.planner.search import divisors
from hybridsp.planner.specs import ClusterSpec, MeshConfig, ModelSpec, Workload


def _check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}")


def _sequence_ok(seq_len: int | None, ulysses: int, ring: int) -> bool:
    if seq_len is None:
        return True
    try:
        check_sequence_length(seq_len, ring, ulysses, LAYOUT)
    except ValueError:
        return False
    return True


def _candidates(context: int, num_heads: int, seq_len: int | None, ulysses: int | None, ring: int | None) -> list[int]:
    """Ulysses degrees that divide the context ranks and the heads and split the sequence."""
    if ulysses is not None and ring is not None and ulysses * ring != context:
        raise ValueError(f"ulysses={ulysses} x ring={ring} = {ulysses * ring} != {context} context ranks")
    if ring is not None:
        if context % ring != 0:
            raise ValueError(f"ring={ring} does not divide the {context} context ranks")
        ulysses = context // ring
    options = [ulysses] if ulysses is not None else divisors(context)
    valid = [u for u in options if context % u == 0 and num_heads % u == 0 and _sequence_ok(seq_len, u, context // u)]
    if not valid:
        raise ValueError(
            f"no Ulysses degree among {options} divides both {context} context ranks and {num_heads} query heads"
            + (f" and splits {seq_len} tokens with the {LAYOUT} layout" if seq_len is not None else "")
        )
    return valid


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
    _check_positive(world_size=world_size, local_world_size=local_world_size, num_heads=num_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim, context_size=context, micro_batch=micro_batch)
    if world_size % local_world_size != 0:
        raise ValueError(f"local world size {local_world_size} does not divide the world size {world_size}")
    if world_size % context != 0:
        raise ValueError(f"context size {context} does not divide the world size {world_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of K/V heads ({num_kv_heads})")
    candidates = _candidates(context, num_heads, seq_len, ulysses, ring)
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
    inside = [u for u in candidates if local_world_size % u == 0]
    chosen = max(inside or candidates)
    return chosen, context // chosen
