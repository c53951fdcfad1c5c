"""The one check of a positive setting (torch-free): degrees, sizes, scales, windows, timeouts; and
the check of a ``head_chunks`` setting."""

from __future__ import annotations

import math


def check_positive(
    value: object,
    name: str,
    *,
    integer: bool = False,
    unit: str = "",
    or_none: str | None = None,
    zero_ok: bool = False,
) -> None:
    """Raise ValueError unless ``value`` is a positive integer (``integer``) or a finite positive number.

    ``unit`` names what it counts ("tokens": "... a positive number of tokens"); ``or_none`` allows
    None and says what None means (``""``: just "or None"); ``zero_ok`` accepts 0 as well. Booleans
    are never numbers here (``True`` is not a degree).
    """
    if value is None and or_none is not None:
        return
    number = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if number and not isinstance(value, bool) and (value >= 0 if zero_ok else value > 0):  # type: ignore[operator]
        return
    sign = "non-negative" if zero_ok else "positive"
    kind = f"a {sign} number of {unit}" if unit else f"a {sign} integer" if integer else f"a finite {sign} number"
    none = "" if or_none is None else f" (or None for {or_none})" if or_none else " or None"
    raise ValueError(f"{name} must be {kind}{none}; got {value!r}")


def check_head_chunks(value: object, name: str = "head_chunks") -> None:
    """Raise ValueError unless ``value`` is a positive integer or ``"auto"`` (the number of head groups
    an attention call runs in turn; whether G divides the heads is checked with the tensors)."""
    if value == "auto":
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    raise ValueError(
        f"{name} must be a positive integer G (attention runs over G head groups in turn; 1: all heads at once) "
        f'or "auto"; got {value!r}'
    )
