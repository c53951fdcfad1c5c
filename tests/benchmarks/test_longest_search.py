"""The longest-S searches of benchmarks.alst._search against a plain rule (a step fits when S <= a limit)."""

import pytest

from benchmarks.alst import _search
from benchmarks.common.alst_stacks import Run


def _probe(limit: int, tried: list[int]):
    def probe(run, seq_len, budget):
        tried.append(seq_len)
        return (True, "") if seq_len <= limit else (False, "MemoryError")

    return probe


@pytest.mark.parametrize("start", [4096, 20480, 36864, 40960, 65536])
@pytest.mark.parametrize("limit", [38000, 40960, 4000])
def test_walk_finds_the_boundary_from_either_side(start, limit):
    tried: list[int] = []
    found = _search.walk(Run(seq_len=start), 1, start, 4096, lambda line: None, _probe(limit, tried))
    best = limit // 4096 * 4096  # the largest multiple of the step that fits (0: none)
    assert found["longest"] == best and found["first_failure"] == best + 4096
    assert all(a["ok"] == (a["seq_len"] <= limit) for a in found["attempts"])
    assert tried == [a["seq_len"] for a in found["attempts"]]
    if start <= limit:  # up from the start to the first failure
        assert tried == list(range(start, found["first_failure"] + 1, 4096))
    else:  # down from the start to the first fit (or the smallest step)
        assert tried == list(range(start, max(found["longest"], 4096) - 1, -4096))
