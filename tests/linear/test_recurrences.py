"""The two recurrences' transitions (hybridsp.linear_attention._delta_rule, .mamba2) against transformers' own kernels: the
state after a segment from any initial state S equals apply(transition pair, S), and the outputs from S equal the
kernel's outputs from S (B > 1, key heads < value heads, Mamba-2 groups shared by heads, odd sizes)."""

from __future__ import annotations

import torch
from transformers.models.nemotron_h import modeling_nemotron_h as nemotron
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from hybridsp.linear_attention._delta_rule import GatedDeltaRule
from hybridsp.linear_attention._mamba2 import Mamba2Scan


def _delta_inputs(batch=2, n=37, hk=2, hv=6, dk=5, dv=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {
        "q": rand(batch, n, hk, dk),
        "k": rand(batch, n, hk, dk),
        "v": rand(batch, n, hv, dv),
        "g": -torch.rand(batch, n, hv, generator=gen) * 0.3,
        "beta": torch.rand(batch, n, hv, generator=gen),
    }


def test_delta_rule_transition_maps_any_initial_state():
    pieces = _delta_inputs()
    rule = GatedDeltaRule(qwen.torch_chunk_gated_delta_rule, value_dim=3)
    pair = rule.transitions(pieces)  # [2, 6, 5, 3 + 5]
    assert pair.shape == (2, 6, 5, 8)
    initial = torch.randn(2, 6, 5, 3)
    out, final = qwen.torch_chunk_gated_delta_rule(
        pieces["q"],
        pieces["k"],
        pieces["v"],
        g=pieces["g"],
        beta=pieces["beta"],
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(rule.apply(pair, initial), final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rule.outputs(pieces, initial), out)


def test_mamba2_transition_maps_any_initial_state():
    gen = torch.Generator().manual_seed(1)
    batch, n, heads, dim, groups, state = 2, 29, 4, 3, 2, 5
    pieces = {
        "x": torch.randn(batch, n, heads, dim, generator=gen),
        "dt": torch.randn(batch, n, heads, generator=gen),
        "B": torch.randn(batch, n, groups, state, generator=gen),
        "C": torch.randn(batch, n, groups, state, generator=gen),
    }
    A, D, dt_bias = (
        -torch.rand(heads, generator=gen),
        torch.randn(heads, generator=gen),
        torch.randn(heads, generator=gen),
    )
    scan = Mamba2Scan(nemotron.mamba2_chunk_scan, A, D, dt_bias, (0.0, float("inf")), chunk_size=8, state_size=state)
    pair = scan.transitions(pieces)  # [2, 4, 3, 5 + 1]
    initial = torch.randn(batch, heads, dim, state)
    out, final = nemotron.mamba2_chunk_scan(
        pieces["x"],
        pieces["dt"],
        A,
        pieces["B"],
        pieces["C"],
        chunk_size=8,
        D=D,
        dt_bias=dt_bias,
        initial_states=initial,
        dt_softplus=True,
        return_final_states=True,
    )
    torch.testing.assert_close(scan.apply(pair, initial), final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scan.outputs(pieces, initial), out)
