"""Temporary stand-in (replaced by the balance branch): per-document head-tail split."""


def balanced_slot_runs(bounds, seq_len, ring, *, window=None):
    per_slot = seq_len // ring
    slots = [[] for _ in range(ring)]
    counts = [0] * ring
    for a, b in zip(bounds[:-1], bounds[1:]):
        n = b - a
        sizes = [n // (2 * ring)] * (2 * ring)
        for j in range(n - sum(sizes)):
            sizes[j] += 1
        pos = a
        for j, size in enumerate(sizes):
            slot = j if j < ring else 2 * ring - 1 - j
            if size:
                slots[slot].append((pos, size))
                counts[slot] += size
            pos += size
    # rebalance token counts: move tail tokens from over-full slots to under-full ones
    flat = []
    for r in range(ring):
        for run in slots[r]:
            flat.append((run[0], run[1], r))
    flat.sort()
    out = [[] for _ in range(ring)]
    fill = [0] * ring
    for start, length, r in flat:
        while length:
            target = r if fill[r] < per_slot else min(range(ring), key=lambda s: fill[s])
            take = min(length, per_slot - fill[target])
            out[target].append((start, take))
            fill[target] += take
            start += take
            length -= take
    return tuple(tuple(sorted(s)) for s in out)
