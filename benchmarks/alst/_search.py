"""The longest sequence a step fits: searches over S that call a probe ``probe(run, S, budget) -> (fits, why)``
(``benchmarks.alst.compare.fits`` in the benchmarks: one capped step; a plain rule in the tests)."""

from __future__ import annotations

from collections.abc import Callable

Probe = Callable[..., tuple[bool, str]]


def attempt(run, length: int, budget: int, attempts: list[dict], log, probe: Probe) -> bool:
    """One step at ``length``, recorded in ``attempts`` and logged: whether it fits."""
    ok, why = probe(run, length, budget)
    attempts.append({"seq_len": length, "ok": ok, "why": why})
    log(f"    {run.name} S={length}: {'fits' if ok else 'fails: ' + why}")
    return ok


def longest(run, budget: int, start: int, granularity: int, log, probe: Probe, ceiling: int | None = None) -> dict:
    """Doubling from ``start`` until a step fails, then bisection to ``granularity``; no attempt beyond
    ``ceiling`` (then ``first_failure`` is None and the longest S is at least ``longest``)."""
    attempts: list[dict] = []
    good, bad = 0, None
    length = start
    while bad is None:
        if ceiling is not None and length > ceiling:
            return {"longest": good, "first_failure": None, "attempts": attempts, "ceiling": ceiling}
        good, bad = (length, None) if attempt(run, length, budget, attempts, log, probe) else (good, length)
        length *= 2
    while bad - good > granularity:
        middle = (good + bad) // 2 // granularity * granularity
        good, bad = (middle, bad) if attempt(run, middle, budget, attempts, log, probe) else (good, middle)
    return {"longest": good, "first_failure": bad, "attempts": attempts}


def walk(run, budget: int, start: int, granularity: int, log, probe: Probe) -> dict:
    """The boundary near a good guess: from ``start`` in steps of ``granularity``, up while a step fits,
    down while it fails (cheaper than :func:`longest` when the guess is within a few steps; a rerun after
    a change that moves the boundary a little)."""
    attempts: list[dict] = []

    def fits_at(length: int) -> bool:
        return attempt(run, length, budget, attempts, log, probe)

    length, step = start, granularity
    if fits_at(length):
        while fits_at(length + step):
            length += step
        return {"longest": length, "first_failure": length + step, "attempts": attempts}
    while length - step > 0 and not fits_at(length - step):
        length -= step
    return {"longest": max(length - step, 0), "first_failure": length, "attempts": attempts}
