"""hybridsp.linear_attention._volume: the per-rank bytes and buffers of a recurrent layer against hand counts, and the
planner's ``--linear`` report (the counters of a real run equal these formulas: benchmarks/attention/linear.py)."""

from __future__ import annotations

import pytest

from hybridsp.__main__ import main
from hybridsp.linear_attention._volume import LinearLayerSpec, linear_layer_bytes, parse_linear

DELTA = LinearLayerSpec("delta_rule", units=4, heads=8, key_dim=32, value_dim=16, conv_kernel=4)


def test_ring_bytes_by_hand_and_independent_of_the_sequence():
    sent = linear_layer_bytes(DELTA, batch=2, seq_len=3072, ulysses=2, ring=3, element_bytes=2)
    pairs = 2 * 2 * 8 * 32 * (16 + 32) // 2 * 4 * 2  # runs x B x pair elements / U x fp32 x (R - 1)
    halos = 2 * 2 * 3 * (2 * 4 * 32 + 8 * 16) // 2 * 2 * 2  # runs x B x (K-1) x channels / U x bf16 x (R - 1)
    assert (sent["ring_states"], sent["ring_halos"]) == (pairs, halos)
    longer = linear_layer_bytes(DELTA, batch=2, seq_len=4 * 3072, ulysses=2, ring=3, element_bytes=2)
    assert (longer["ring_states"], longer["ring_halos"]) == (pairs, halos)
    assert longer["gather_sequence"] - longer["ulysses"] == 4 * (sent["gather_sequence"] - sent["ulysses"])


def test_mamba2_pair_is_a_state_and_a_decay_per_head():
    spec = LinearLayerSpec("mamba2", units=2, heads=6, key_dim=8, value_dim=5)
    assert spec.pair_elements == 6 * 5 * (8 + 1) and spec.conv_channels == 6 * 5 + 2 * 2 * 8


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="kind must be"):
        LinearLayerSpec("rwkv", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="7 heads do not divide into 2 groups"):
        LinearLayerSpec("mamba2", 2, 7, 8, 8)
    with pytest.raises(ValueError, match="KIND:LAYERS"):
        parse_linear("delta_rule:36:16")


def test_planner_reports_the_linear_layers(capsys):
    common = ["plan", "--model", "llama3-8b", "--seq-len", "128k", "--zero", "3", "--top", "1"]
    assert main([*common, "--ulysses", "2", "--ring", "4", "--linear", "delta_rule:24:16:32:128:128"]) == 0
    out = capsys.readouterr().out
    # 2 runs x 16 of 32 value heads x 128 x (128 + 128) fp32 x 3 other ring ranks = 12 MiB
    assert "Linear layers (24 x delta_rule, U=2 x R=4)" in out and "ring state pairs 12.00 MiB" in out
    assert main([*common, "--ulysses", "8", "--ring", "1", "--linear", "mamba2:27:4:128:128:64"]) == 1  # no valid mesh
    assert "the linear layers' 4 groups are not divisible by U=8" in capsys.readouterr().out
