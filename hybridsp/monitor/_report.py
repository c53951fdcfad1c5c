"""What the exactness probe returns: one :class:`ParityRow` per attention layer, the loss, the worst entry.

Note [parity tolerance]: flash-attn's rule. An entry passes when its relative error against the
float64 reference is at most ``factor`` (2) times the relative error of the *same-dtype
single-device* plain math on the same inputs (the baseline, measured per layer and quantity), plus a
floor per dtype (:data:`FLOORS`) for layers where the baseline happens to be tiny. The loss row has
fixed tolerances: the loss against a float64 cross-entropy of the same logits (:data:`LOSS_TOLERANCE`)
and the logits' gradient at the targets (:data:`DLOGITS_TOLERANCE`, two units in the last place). A relative error
is ``max |x - ref| / max |ref|`` over the whole gathered tensor, so it does not depend on scale. A
non-finite value is an error of ``inf``. ``rtol=`` overrides the rule with one fixed tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

QUANTITIES = ("out", "dq", "dk", "dv")  # per attention layer; the loss row has "loss" and "dlogits"
FLOORS = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 4e-3, torch.float16: 1e-3}
LOSS_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}
DLOGITS_TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # 2 ulps


def tolerance(dtype: torch.dtype, baseline: float, factor: float = 2.0, rtol: float | None = None) -> float:
    """Note [parity tolerance]: ``rtol`` if given, else ``factor * baseline + FLOORS[dtype]``."""
    if rtol is not None:
        return rtol
    return factor * (baseline if math.isfinite(baseline) else 0.0) + FLOORS.get(dtype, FLOORS[torch.float32])


class Worst(NamedTuple):
    """The entry nearest to (or furthest past) its tolerance: ``layer`` (None for the loss), ``quantity``,
    ``rel_error``, ``tolerance`` and ``rank`` (the rank that computed its worst element; -1 if unknown)."""

    layer: int | None
    quantity: str
    rel_error: float
    tolerance: float
    rank: int


@dataclass(frozen=True)
class ParityRow:
    """One attention layer (or the loss, ``layer=None``): per quantity its relative error, tolerance,
    same-dtype baseline error and the rank that computed the worst element."""

    layer: int | None
    errors: dict[str, float]
    tolerances: dict[str, float]
    baselines: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every quantity within its tolerance (a NaN or inf never is)."""
        return all(self.passes(q) for q in self.errors)

    def passes(self, quantity: str) -> bool:
        """``quantity`` within its tolerance."""
        return self.errors[quantity] <= self.tolerances[quantity]

    def entries(self) -> list[Worst]:
        return [Worst(self.layer, q, self.errors[q], self.tolerances[q], self.ranks.get(q, -1)) for q in self.errors]


@dataclass(frozen=True)
class ParityReport:
    """The probe's answer, the same on every rank: ``rows`` (one per attention layer, in call order),
    ``loss`` (the loss row), ``dtype``, ``mesh`` (a one-line description), ``ok`` and ``worst``."""

    rows: tuple[ParityRow, ...]
    loss: ParityRow
    dtype: torch.dtype
    mesh: str = ""

    @property
    def ok(self) -> bool:
        return self.loss.ok and all(row.ok for row in self.rows)

    @property
    def worst(self) -> Worst:
        """Where a failure first appears: the first failing entry in the order of computation (forward
        outputs layer by layer, the loss, then the gradients from the last layer down). When everything
        passes: the entry closest to its tolerance."""
        order = [e for row in self.rows for e in row.entries() if e.quantity == "out"] + self.loss.entries()
        order += [e for row in reversed(self.rows) for e in row.entries() if e.quantity != "out"]
        first_bad = next((e for e in order if not e.rel_error <= e.tolerance), None)
        if first_bad is not None:
            return first_bad
        return max(order, key=lambda e: e.rel_error / e.tolerance if e.tolerance > 0 else math.inf)

    def table(self) -> str:
        """The report as a text table: one line per layer, then the loss and a verdict line."""
        head = f"{'layer':>5}  " + "  ".join(f"{q:>9}" for q in QUANTITIES) + "  " + f"{'tol(out)':>9}  status"
        lines = [f"parity of {self.mesh} in {str(self.dtype).removeprefix('torch.')} (relative error vs float64)", head]
        for row in self.rows:
            cells = "  ".join(f"{_num(row.errors.get(q)):>9}" for q in QUANTITIES)
            status = "ok" if row.ok else "FAIL " + ", ".join(q for q in row.errors if not row.passes(q))
            lines.append(f"{row.layer!s:>5}  {cells}  {_num(row.tolerances.get('out')):>9}  {status}")
        loss = self.loss
        lines.append(
            f"{'loss':>5}  loss {_num(loss.errors['loss'])} (tol {_num(loss.tolerances['loss'])}), "
            f"dlogits {_num(loss.errors['dlogits'])} (tol {_num(loss.tolerances['dlogits'])})  "
            + ("ok" if loss.ok else "FAIL")
        )
        worst = self.worst
        where = "loss" if worst.layer is None else f"layer {worst.layer}"
        verdict = "PASS" if self.ok else "FAIL"
        lines.append(
            f"{verdict}: worst {where} {worst.quantity} {_num(worst.rel_error)} (tolerance {_num(worst.tolerance)}"
            + (f", computed on rank {worst.rank})" if worst.rank >= 0 else ")")
        )
        return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}" if math.isfinite(value) else str(value)
