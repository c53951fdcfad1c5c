"""Ulysses and ring degrees from what a launcher knows: the rule ``init_mesh(ulysses="auto")`` uses.

Below both :mod:`hybridsp.mesh._hybrid_mesh` and :mod:`hybridsp.planner` (the planner's
:func:`~hybridsp.planner.plan_degrees` adds a cost-model choice on top of these candidates),
so the mesh never imports the planner.

Rule (nothing else known): the largest U that divides the query heads, the context size and
``local_world_size`` (so a Ulysses group never leaves a node), the rest ring; with
``seq_len``, degrees the layout cannot split are skipped.
"""

from __future__ import annotations

from hybridsp._checks import check_positive
from hybridsp._formulas import heads_divisible
from hybridsp.layout._layouts import check_sequence_length

LAYOUT = "zigzag"  # the layout the degree choice assumes (init_mesh's default)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_positive_ints(**values: object) -> None:
    """Raise ValueError naming the first argument that is not a positive integer."""
    for name, value in values.items():
        check_positive(value, name, integer=True)


def sequence_splits(seq_len: int | None, ulysses: int, ring: int, layout: str = LAYOUT) -> bool:
    """Whether ``layout`` splits ``seq_len`` tokens over ring x ulysses (True when unknown)."""
    if seq_len is None:
        return True
    try:
        check_sequence_length(seq_len, ring, ulysses, layout)
    except ValueError:
        return False
    return True


def check_launch(
    world_size: int,
    local_world_size: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    micro_batch: int = 1,
) -> None:
    """Raise ValueError, quoting the numbers, for sizes no degree choice can work with."""
    check_positive_ints(
        world_size=world_size,
        local_world_size=local_world_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        context_size=context,
        micro_batch=micro_batch,
    )
    if world_size % local_world_size != 0:
        raise ValueError(f"local world size {local_world_size} does not divide the world size {world_size}")
    if world_size % context != 0:
        raise ValueError(f"context size {context} does not divide the world size {world_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"the model's query heads ({num_heads}) must be a multiple of its key/value heads ({num_kv_heads}); "
            f"pass the model's own num_attention_heads and num_key_value_heads (GQA groups query heads evenly)"
        )


def ulysses_candidates(
    context: int, num_heads: int, seq_len: int | None, ulysses: int | None, ring: int | None, layout: str = LAYOUT
) -> list[int]:
    """Ulysses degrees that divide the context ranks and the heads and split the sequence
    (only the one fixed by ``ulysses`` or ``ring`` when given)."""
    if ulysses is not None and ring is not None and ulysses * ring != context:
        raise ValueError(f"ulysses={ulysses} x ring={ring} = {ulysses * ring} != {context} context ranks")
    if ring is not None:
        if context % ring != 0:
            raise ValueError(f"ring={ring} does not divide the {context} context ranks")
        ulysses = context // ring
    options = [ulysses] if ulysses is not None else divisors(context)
    valid = [
        u
        for u in options
        if context % u == 0 and heads_divisible(num_heads, u) and sequence_splits(seq_len, u, context // u, layout)
    ]
    if not valid:
        raise ValueError(
            f"no Ulysses degree among {options} divides both {context} context ranks and {num_heads} query heads"
            + (f" and splits {seq_len} tokens with the {layout} layout" if seq_len is not None else "")
        )
    return valid


def largest_inside_node(candidates: list[int], local_world_size: int) -> int:
    """The largest candidate that divides the ranks per node (else the largest candidate)."""
    inside = [u for u in candidates if local_world_size % u == 0]
    return max(inside or candidates)


def choose_degrees(
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
) -> tuple[int, int]:
    """``(ulysses, ring)`` by the module's rule for a context group of ``context_size`` ranks
    (default: the whole world). Fix one degree by passing it to get the other. Raises
    ValueError, quoting the numbers, when nothing fits."""
    context = world_size if context_size is None else context_size
    check_launch(world_size, local_world_size, context, num_heads, num_kv_heads, head_dim)
    chosen = largest_inside_node(ulysses_candidates(context, num_heads, seq_len, ulysses, ring), local_world_size)
    return chosen, context // chosen
