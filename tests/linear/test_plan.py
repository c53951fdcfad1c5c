"""The sequence-order plan of a slot's runs (hybridsp.linear_attention._segments) on the host, against brute force: natural
order, segments cut at document starts, and every convolution tap of every slot (from the slot, a gathered
halo or zero) equal to a depthwise causal conv run per document on the whole row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridsp.layout._layouts import get_layout
from hybridsp.linear_attention._segments import conv_taps, row_plan, tail_index

CASES = [  # (layout, ring, seq_len, bounds)
    ("zigzag", 2, 120, (0, 120)),
    ("zigzag", 3, 48, (0, 20, 21, 24, 38, 48)),
    ("contiguous", 2, 48, (0, 30, 48)),
    ("balanced", 2, 48, (0, 20, 21, 24, 38, 48)),  # runs cut documents across slots
    ("balanced", 3, 60, (0, 2, 3, 40, 41, 60)),
]


def test_zigzag_u2r2_states_flow_in_token_order():
    """120 tokens at R = 2: slot 0 holds [0,30) and [90,120), slot 1 holds [30,60) and [60,90) (at U = 2: ranks
    r0u0, r1u0, r1u1, r0u1): the chain reads slot 0 run 0, slot 1 runs 0 and 1, slot 0 run 1."""
    plan = row_plan(get_layout("zigzag"), 120, 2, (0, 120))
    assert plan.order == ((0, 0), (1, 0), (1, 1), (0, 1))
    assert [s.chained for s in plan.segments[0]] == [False, True]
    assert plan.starts == ((True, False), (False, False)) and plan.restarts == ((True, False), (False, False))


@pytest.mark.parametrize("layout, ring, seq_len, bounds", CASES)
def test_segments_partition_the_slot_and_cut_at_documents(layout, ring, seq_len, bounds):
    plan = row_plan(get_layout(layout), seq_len, ring, bounds)
    positions = []
    for segments in plan.segments:
        offset = 0
        for seg in segments:
            assert seg.offset == offset
            offset += seg.length
            positions += range(seg.start, seg.start + seg.length)
            inside = [b for b in bounds[1:-1] if seg.start < b < seg.start + seg.length]
            assert not inside, f"segment {seg} crosses a document start"
            assert seg.chained == (seg.start not in bounds)
    assert sorted(positions) == list(range(seq_len))
    starts = [plan.runs[s][j][0] for s, j in plan.order]
    assert starts == sorted(starts)


def _slot_positions(plan, slot):
    return torch.cat([torch.arange(start, start + length) for start, length in plan.runs[slot]])  # [L]


@pytest.mark.parametrize("layout, ring, seq_len, bounds", CASES)
@pytest.mark.parametrize("kernel", [2, 4])
def test_conv_taps_equal_a_per_document_conv(layout, ring, seq_len, bounds, kernel):
    """Every slot's taps over [own tokens, all slots' gathered tails, zero] give the conv of the row run per
    document (F.conv1d with kernel - 1 zeros in front of each document)."""
    torch.manual_seed(0)
    channels = 3
    x = torch.randn(seq_len, channels)  # [S, C]
    weight = torch.randn(channels, kernel)  # [C, K]
    expected = torch.cat(
        [
            F.conv1d(x[lo:hi].T[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, : hi - lo].T
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ]
    )  # [S, C]
    plan = row_plan(get_layout(layout), seq_len, ring, bounds)
    slots = [x[_slot_positions(plan, s)] for s in range(ring)]  # each [L, C]
    tails = torch.stack(
        [torch.cat([t, t.new_zeros(1, channels)])[tail_index(plan, s, kernel - 1)] for s, t in enumerate(slots)]
    )  # [R, M * (K-1), C]
    for slot in range(ring):
        ext = torch.cat([slots[slot], tails.flatten(0, 1), x.new_zeros(1, channels)])  # [L + R*M*(K-1) + 1, C]
        taps = conv_taps(plan, slot, kernel, bounds)  # [L, K]
        out = sum(ext[taps[:, i]] * weight[:, i] for i in range(kernel))  # [L, C]
        torch.testing.assert_close(out, expected[_slot_positions(plan, slot)], rtol=1e-5, atol=1e-6)
