"""A bounded cache of token layouts' slot runs, sized by bytes (Note [runs cache]).

Note [runs cache]. A layout's slot runs (a few ``(start, length)`` pairs per ring slot) are a
pure function of (layout and its window, sequence length, ring, a row's boundaries), and the balanced
layout's cost a few to a hundred ms of host CPU per row to compute, so they are cached. The
cache keeps runs, never permutations: a permutation is ``S`` int64 values (8 MiB at S = 1M),
rebuilt from the runs in O(S) vectorised work (:func:`hybridsp.layout._layouts.layout_permutation`),
while a row's runs and its boundaries take about 40 bytes per document and 140 bytes per run.
The cache is an LRU bounded by the *estimated* bytes of its keys and values
(:func:`entry_bytes`, which overestimates a little: 55 KB for a lognormal row of S = 1M with 926
documents and 128 runs at R = 4, 42 KB measured; :data:`RUNS_CACHE_BYTES`, 32 MiB, holds ~600 such
rows and tens of thousands at S = 16K), so a process's memory stays flat over any number of distinct
packs, and it is keyed per batch row, so a batch of B rows needs B entries (not one per batch).
One process-wide instance (:data:`RUNS_CACHE`): bounded, thread-safe, and only a cache (clearing
it changes no result).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Callable, Hashable

RUNS_CACHE_BYTES = 32 << 20  # the process-wide cache's budget (estimated bytes of keys and runs)
_ENTRY_BYTES = 200  # an entry's fixed cost: the key tuple, the dict slot, the outer runs tuple
_BOUND_BYTES = 40  # one document boundary in the key: an int and its tuple slot
_SLOT_BYTES = 64  # one slot's tuple of runs
_RUN_BYTES = 140  # one (start, length) run: the pair and its two ints

Runs = tuple[tuple[tuple[int, int], ...], ...]  # per slot: (global start, length) runs in slot order


def entry_bytes(bounds: Sequence[int] | None, runs: Runs) -> int:
    """Estimated host bytes of one entry: ``bounds`` (a row's boundaries or None) and its runs."""
    count = 0 if bounds is None else len(bounds)
    return _ENTRY_BYTES + _BOUND_BYTES * count + sum(_SLOT_BYTES + _RUN_BYTES * len(slot) for slot in runs)


class RunsCache:
    """LRU of ``key -> runs`` holding at most ``max_bytes`` estimated bytes (Note [runs cache])."""

    def __init__(self, max_bytes: int = RUNS_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"a runs cache needs a budget of >= 0 bytes; got {max_bytes}")
        self.max_bytes = max_bytes
        self.nbytes = 0  # estimated bytes held now (<= max_bytes)
        self.hits = self.misses = 0
        self._entries: OrderedDict[Hashable, tuple[Runs, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, bounds: Sequence[int] | None, compute: Callable[[], Runs]) -> Runs:
        """The runs of ``key`` (``compute()`` on a miss); ``bounds`` sizes the key (None: none)."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found[0]
            self.misses += 1
        runs = compute()
        self._put(key, runs, entry_bytes(bounds, runs))
        return runs

    def _put(self, key: Hashable, runs: Runs, size: int) -> None:
        """Insert (unless larger than the whole budget), evicting least recently used entries."""
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (runs, size)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, (_, freed) = self._entries.popitem(last=False)
                self.nbytes -= freed

    def clear(self) -> None:
        """Drop every entry (and the counters)."""
        with self._lock:
            self._entries.clear()
            self.nbytes = self.hits = self.misses = 0


RUNS_CACHE = RunsCache()
