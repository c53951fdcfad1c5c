"""Bytes and buffers of one recurrent layer per rank: torch-free formulas for the planner and the benchmark.

Per layer and forward, one rank of a ``U x R`` context group sends (Note [linear bytes]):

- ``ulysses``: the all-to-all of the packed per-group inputs to the ring slot's tokens and of the
  outputs back (``(U - 1) / U`` of each);
- ``ring_states``: the all-gather of its runs' transition pairs, fp32, ``(R - 1)`` copies;
- ``ring_halos``: the all-gather of its runs' last ``K - 1`` conv inputs, ``(R - 1)`` copies.

For comparison, two other ways to run the same layer: ``gather_sequence`` (every ring rank
all-gathers its head slice's whole sequence and recomputes it: ``(R - 1)`` copies of its slot's
inputs) and ``ulysses_only`` (the whole context on the Ulysses axis, ``C`` ranks of head groups,
which needs ``C`` to divide the groups). Backward moves the same again (the adjoints; the
all-gathers' adjoint is an all-reduce of ``R`` times their size, Note [gather adjoint]).

Note [linear bytes]: the pair of a Gated DeltaNet run is ``[dk, dv + dk]`` per value head, of a
Mamba-2 run ``[P, N + 1]`` per head; neither depends on the sequence length, so ring state passing
costs ``R - 1`` small matrices per run where gathering the sequence costs ``(R - 1) S / R`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridsp._checks import check_positive


@dataclass(frozen=True)
class LinearLayerSpec:
    """One recurrent layer's shapes.

    kind: ``"delta_rule"`` (Gated DeltaNet: ``units`` key heads, ``heads`` value heads, ``key_dim``
    dk, ``value_dim`` dv) or ``"mamba2"`` (``units`` B/C groups, ``heads`` heads, ``key_dim`` the
    state size N, ``value_dim`` the head dim P). conv_kernel: K.
    """

    kind: str
    units: int
    heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        if self.kind not in ("delta_rule", "mamba2"):
            raise ValueError(f"LinearLayerSpec.kind must be 'delta_rule' or 'mamba2'; got {self.kind!r}")
        for name in ("units", "heads", "key_dim", "value_dim", "conv_kernel"):
            check_positive(getattr(self, name), f"LinearLayerSpec.{name}", integer=True)
        if self.heads % self.units:
            raise ValueError(f"LinearLayerSpec: {self.heads} heads do not divide into {self.units} groups")

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv (q, k, v or x, B, C)."""
        if self.kind == "delta_rule":
            return 2 * self.units * self.key_dim + self.heads * self.value_dim
        return self.heads * self.value_dim + 2 * self.units * self.key_dim

    @property
    def features(self) -> int:
        """Per-token features the Ulysses all-to-all moves to the slot (conv inputs, gates' b/a or dt)."""
        per_head = 2 if self.kind == "delta_rule" else 1
        return self.conv_channels + per_head * self.heads

    @property
    def pair_elements(self) -> int:
        """fp32 elements of one run's transition pair, all heads."""
        if self.kind == "delta_rule":
            return self.heads * self.key_dim * (self.value_dim + self.key_dim)
        return self.heads * self.value_dim * (self.key_dim + 1)

    @property
    def state_elements(self) -> int:
        """Elements of the recurrent state, all heads."""
        return self.heads * self.key_dim * self.value_dim


def linear_layer_bytes(
    spec: LinearLayerSpec,
    batch: int,
    seq_len: int,
    ulysses: int,
    ring: int,
    runs_per_slot: int = 2,
    element_bytes: int = 2,
) -> dict[str, int]:
    """Bytes one rank sends in one forward of the layer (Note [linear bytes]); ``runs_per_slot``: 2 for
    zigzag, 1 contiguous, more for the balanced layout; ``element_bytes``: the activations' dtype."""
    context = ulysses * ring
    local = batch * seq_len // context  # tokens of this rank
    out_features = spec.heads * spec.value_dim
    a2a = (local * spec.features + local * out_features) * element_bytes * (ulysses - 1) // ulysses
    states = runs_per_slot * batch * spec.pair_elements // ulysses * 4 * (ring - 1)
    halos = runs_per_slot * batch * (spec.conv_kernel - 1) * spec.conv_channels // ulysses * element_bytes * (ring - 1)
    slot_tokens = batch * seq_len // ring
    gathered = slot_tokens * spec.conv_channels // ulysses * element_bytes * (ring - 1)
    only = (local * spec.features + local * out_features) * element_bytes * (context - 1) // context
    return {
        "ulysses": a2a,
        "ring_states": states,
        "ring_halos": halos,
        "total": a2a + states + halos,
        "gather_sequence": a2a + gathered,
        "ulysses_only": only,
    }


def linear_layer_memory(
    spec: LinearLayerSpec,
    batch: int,
    seq_len: int,
    ulysses: int,
    ring: int,
    runs_per_slot: int = 2,
    element_bytes: int = 2,
) -> dict[str, int]:
    """Bytes one rank holds for the layer's sharded call: the slot's inputs of its head groups, the
    gathered pairs and halos (all ring slots) and the states it restarts its runs from."""
    slot_tokens = batch * seq_len // ring
    pairs = ring * runs_per_slot * batch * spec.pair_elements // ulysses * 4
    halos = ring * runs_per_slot * batch * (spec.conv_kernel - 1) * spec.conv_channels // ulysses * element_bytes
    states = runs_per_slot * batch * spec.state_elements // ulysses * 4
    inputs = slot_tokens * spec.features // ulysses * element_bytes
    return {
        "slot_inputs": inputs,
        "gathered_pairs": pairs,
        "gathered_halos": halos,
        "initial_states": states,
        "total": inputs + pairs + halos + states,
    }


def parse_linear(text: str) -> tuple[LinearLayerSpec, int]:
    """``KIND:LAYERS:UNITS:HEADS:KEY_DIM:VALUE_DIM[:CONV]`` (``python -m hybridsp plan --linear``) -> (spec,
    layers), e.g. ``delta_rule:36:16:32:128:128`` (Qwen3-Next-80B's 36 Gated DeltaNet layers) or
    ``mamba2:27:8:128:128:64`` (Mamba-2: groups, heads, state size, head dim)."""
    parts = text.split(":")
    if len(parts) not in (6, 7) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(
            f"--linear expects KIND:LAYERS:UNITS:HEADS:KEY_DIM:VALUE_DIM[:CONV] with integers, e.g. "
            f"delta_rule:36:16:32:128:128; got {text!r}"
        )
    numbers = [int(p) for p in parts[1:]]
    return LinearLayerSpec(parts[0], *numbers[1:]), numbers[0]


def linear_report(
    spec: LinearLayerSpec, layers: int, batch: int, seq_len: int, ulysses: int, ring: int, element_bytes: int = 2
) -> str:
    """What the recurrent layers cost at ``ulysses x ring`` (the planner's report lines)."""
    if spec.units % ulysses:
        return (
            f"Linear layers: {spec.units} {'key heads' if spec.kind == 'delta_rule' else 'groups'} are not "
            f"divisible by Ulysses {ulysses}: hybridsp refuses this mesh for them; choose U dividing {spec.units}"
        )
    sent = linear_layer_bytes(spec, batch, seq_len, ulysses, ring, element_bytes=element_bytes)
    held = linear_layer_memory(spec, batch, seq_len, ulysses, ring, element_bytes=element_bytes)
    mib = 2**20
    return (
        f"Linear layers ({layers} x {spec.kind}, U={ulysses} x R={ring}), per layer and rank, forward: "
        f"all-to-all {sent['ulysses'] / mib:.2f} MiB, ring state pairs {sent['ring_states'] / mib:.2f} MiB, "
        f"conv halos {sent['ring_halos'] / mib:.3f} MiB (gathering the sequence instead: "
        f"{sent['gather_sequence'] / mib:.2f} MiB; the whole context on Ulysses: {sent['ulysses_only'] / mib:.2f} "
        f"MiB); buffers {held['total'] / mib:.2f} MiB (slot inputs {held['slot_inputs'] / mib:.2f}, gathered pairs "
        f"{held['gathered_pairs'] / mib:.2f}); all {layers} layers: {layers * sent['total'] / mib:.1f} MiB sent. "
        f"(The table above models every layer as attention.)"
    )
