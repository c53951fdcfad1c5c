"""The started-now, finished-later to-heads all-to-all (``hybridsp.attention._prefetch``) against the
synchronous one: the same heads-first buffers bitwise and the same bytes counted, for B = 2, a v with its
own head dim (two exchanges), strided inputs, two exchanges in flight at once and a synchronous
all-to-all on the same group issued while one is in flight (the order head-chunked attention uses)."""

import pytest
import torch
import torch.distributed as dist

from hybridsp._comm import CommCounter
from hybridsp.attention._prefetch import start_seq_to_heads_buffers
from hybridsp.attention._ulysses import heads_to_seq_plain, seq_to_heads_buffers


def _inputs(rank: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * seed + rank)
    q = torch.randn(2, 6, 4, 8, generator=gen)  # [B, L, H, D]
    k = torch.randn(2, 4, 6, 8, generator=gen).transpose(1, 2)  # [B, L, Hkv, D], heads-first storage
    v = torch.randn(2, 6, 4, 5, generator=gen)  # its own head dim: a second exchange
    return [q, k, v]


def _compare(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    sync_counter, async_counter = CommCounter(), CommCounter()
    first = start_seq_to_heads_buffers(_inputs(rank, 0), group, async_counter)
    second = start_seq_to_heads_buffers(_inputs(rank, 1), group, async_counter)  # two in flight
    moved = heads_to_seq_plain([torch.randn(2, 12, 2, 8)], group)  # a synchronous one meanwhile
    assert moved[0].shape == (2, 6, 4, 8)
    got = first.wait() + second.wait()
    want = seq_to_heads_buffers(_inputs(rank, 0), group, sync_counter) + seq_to_heads_buffers(
        _inputs(rank, 1), group, sync_counter
    )
    shapes = [tuple(t.shape) for t in got]
    assert shapes == [tuple(t.shape) for t in want] == [(2, 4, 12, 8), (2, 2, 12, 5)] * 2, shapes
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert async_counter.bytes_sent == sync_counter.bytes_sent and async_counter.calls == sync_counter.calls
    assert async_counter.total() > 0


@pytest.mark.distributed
def test_started_exchange_equals_the_synchronous_one():
    from hybridsp.testing import run_distributed

    run_distributed(_compare, 2)
