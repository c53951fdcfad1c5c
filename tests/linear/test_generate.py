"""Generation of hybrid linear-attention models under U x R: ``hybridsp.integrations.transformers.generate`` on a
switched Qwen3.5 / Nemotron-H (the recurrent layers' final state and conv tail kept on every context rank after the
sharded prefill, stepped locally in decode) against the unmodified model's own ``model.generate``: greedy ids equal,
the logits that chose each token within a relative 1e-4."""

from __future__ import annotations

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.linear_workers import generation_errors

TOLERANCE = 1e-4


def _check(found: dict) -> None:
    for name, (equal, error) in found.items():
        assert equal, f"{name}: greedy ids differ from model.generate (logits' relative error {error:.2e})"
        assert error < TOLERANCE, f"{name}: logits' relative error {error:.2e}"


def test_greedy_ids_equal_model_generate():
    """B = 2, U2xR2 (a 13-token prompt: right padding to 16 stays out of the state) and U1xR2 (a 2-token prompt,
    shorter than the conv window), both mixer kinds, in one 4-rank spawn."""
    cases = [
        ("qwen3_5 U2xR2", "qwen3_5", 2, 2, 13, 5),
        ("qwen3_5 U1xR2", "qwen3_5", 1, 2, 2, 5),
        ("nemotron_h U2xR2", "nemotron_h", 2, 2, 13, 5),
        ("nemotron_h U1xR2", "nemotron_h", 1, 2, 7, 5),
    ]
    _check(run_distributed(generation_errors, 4, cases, timeout=400)[0])


@pytest.mark.slow
def test_greedy_ids_qwen3_next_and_three_ring_ranks():
    """Qwen3-Next (fused projections) at U1xR3 and a longer prompt at U1xR3 for both other families."""
    cases = [
        ("qwen3_next U1xR3", "qwen3_next", 1, 3, 29, 6),
        ("qwen3_5 U1xR3", "qwen3_5", 1, 3, 40, 6),
        ("nemotron_h U1xR3", "nemotron_h", 1, 3, 40, 6),
    ]
    _check(run_distributed(generation_errors, 3, cases, timeout=400)[0])
