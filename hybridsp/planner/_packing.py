"""Packed documents in the planner: how unevenly a layout spreads causal attention work over the ring.

Every ring step waits for the busiest rank, so on packed data the attention part of a step
costs ``imbalance = max / mean`` of the ranks' work instead of the mean. :func:`packing_imbalance`
computes it for the zigzag and the balanced layout from a row's document lengths (the work model
of :mod:`hybridsp.layout._balance.tries`: a token at offset ``p`` of its document attends to ``min(p + 1, W)``
keys); :func:`packing_traffic` the K/V rows each ships per ring pass and the floor no layout
within 5% balance goes under (:mod:`hybridsp.layout._balance.bound`); :func:`packing_summary` both, once,
with a paragraph on what ``layout="balanced"`` buys and what it costs; :func:`attention_work_fraction`
the share of an unpacked row's attention work a packed row does (the planner's step time uses it).
Host arithmetic only.
"""

from __future__ import annotations

import itertools

from hybridsp.layout._balance.bound import kv_rows_lower_bound
from hybridsp.layout._balance.work import hull_rows, slot_work
from hybridsp.layout._layouts import get_layout


def pack_bounds(doc_lengths: list[int], seq_len: int) -> tuple[int, ...]:
    """Boundaries of one row packed with ``doc_lengths`` repeated until ``seq_len`` tokens (the last cut)."""
    if not doc_lengths or any(n < 1 for n in doc_lengths):
        raise ValueError(f"--doc-lengths needs positive document lengths; got {doc_lengths}")
    bounds, position = [0], 0
    for length in itertools.cycle(doc_lengths):
        position = min(seq_len, position + length)
        bounds.append(position)
        if position == seq_len:
            return tuple(bounds)
    raise AssertionError("unreachable")


def attention_work_fraction(doc_lengths: list[int], seq_len: int, causal: bool = True) -> float:
    """The attention work of one row packed with ``doc_lengths`` (repeated to ``seq_len``) as a fraction
    of one ``seq_len``-token document's: documents attend only within themselves, so a row of n
    documents of S/n tokens does about 1/n of the work. Causal: sum of d(d+1)/2 over S(S+1)/2;
    bidirectional: sum of d^2 over S^2."""
    bounds = pack_bounds(doc_lengths, seq_len)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    if causal:
        return sum(d * (d + 1) for d in sizes) / (seq_len * (seq_len + 1))
    return sum(d * d for d in sizes) / seq_len**2


def _packed_row(doc_lengths: list[int], seq_len: int, ring: int) -> tuple[int, tuple[int, ...]]:
    """(S rounded down to a multiple of 2R, the row's boundaries) as both layouts split it."""
    seq_len = seq_len // (2 * ring) * (2 * ring)
    return seq_len, pack_bounds(doc_lengths, seq_len)


def packing_imbalance(doc_lengths: list[int], seq_len: int, ring: int, window: int | None = None) -> dict[str, float]:
    """``{layout: busiest ring rank's work / mean}`` for ``zigzag`` and ``balanced`` (placing for ``window``) on
    one packed row (work: the visible cells, :func:`~hybridsp.layout._balance.work.slot_work`)."""
    seq_len, bounds = _packed_row(doc_lengths, seq_len, ring)
    result = {}
    for name in ("zigzag", "balanced"):
        work = slot_work(get_layout(name, window).slot_runs(seq_len, ring, bounds), bounds, window)
        result[name] = max(work) * ring / sum(work)
    return result


def packing_traffic(doc_lengths: list[int], seq_len: int, ring: int) -> dict[str, float]:
    """K/V rows one ring pass ships (full causal; the same rows travel again in the backward) under
    ``zigzag`` and ``balanced``, and ``floor_105``: the fewest any layout within 5% balance ships."""
    seq_len, bounds = _packed_row(doc_lengths, seq_len, ring)
    rows = {
        name: hull_rows(get_layout(name).slot_runs(seq_len, ring, bounds), bounds) for name in ("zigzag", "balanced")
    }
    return {**rows, "floor_105": kv_rows_lower_bound(bounds, seq_len, ring, 1.05)}


def packing_summary(doc_lengths: list[int], seq_len: int, ring: int, window: int | None = None) -> dict:
    """Both layouts' imbalance (``zigzag``, ``balanced``), ``kv_rows`` (:func:`packing_traffic`; not
    with a window) and ``report``: one paragraph on what ``layout="balanced"`` buys and costs."""
    ratio = packing_imbalance(doc_lengths, seq_len, ring, window)
    rows = packing_traffic(doc_lengths, seq_len, ring) if window is None else None
    report = (
        "packed documents: a ring of one has no imbalance (every layout is the same)"
        if ring == 1
        else _report(doc_lengths, ring, ratio, rows)
    )
    return {**ratio, "kv_rows": rows, "report": report}


def packing_report(doc_lengths: list[int], seq_len: int, ring: int, window: int | None = None) -> str:
    """One paragraph: both layouts' imbalance at this ring degree, the attention time balanced saves
    and the K/V rows it ships."""
    return packing_summary(doc_lengths, seq_len, ring, window)["report"]


def _report(doc_lengths: list[int], ring: int, ratio: dict, rows: dict | None) -> str:
    gain = ratio["zigzag"] / ratio["balanced"]
    traffic = ""
    if rows and rows["zigzag"]:
        floor = (
            f" (no layout within 5% balance ships under {rows['floor_105'] / rows['zigzag']:.2f}x)"
            if rows["floor_105"]
            else ""
        )
        traffic = (
            f"; it ships {rows['balanced'] / rows['zigzag']:.2f}x zigzag's K/V rows per ring pass{floor}, "
            f"which matters only where the ring's transfers are not hidden behind attention"
        )
    return (
        f"packed documents (lengths {doc_lengths[:6]}{'...' if len(doc_lengths) > 6 else ''}, ring {ring}): "
        f"the busiest ring rank does {ratio['zigzag']:.2f}x the mean attention work with layout='zigzag', "
        f"{ratio['balanced']:.2f}x with layout='balanced': the ring's attention runs {gain:.2f}x faster with "
        f"'balanced'"
        + (' (pick it: hybridsp.init_mesh(..., layout=\'balanced\') or "layout": "balanced")' if gain > 1.02 else "")
        + traffic
    )
