"""Generation of hybrid linear-attention models under U x R: ``hybridsp.integrations.transformers.generate`` on a
switched Qwen3.5 / Nemotron-H (the recurrent layers' final state and conv tail kept on every context rank after the
sharded prefill, stepped locally in decode) against the unmodified model's own ``model.generate``: greedy ids equal,
the logits that chose each token within a relative 1e-5 (measured at most 3.4e-7). The bound is tight because the
tiny Nemotron-H's decode depends little on its Mamba-2 state: decoding from a zero state or from the state after
the prompt's right padding moves its logits by 4.2e-5 and 4.5e-5 relative (a zero conv tail changes its ids; each of
the three changes Qwen3.5's logits by 0.16 to 1.3)."""

from __future__ import annotations

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.workers.linear import generation_errors

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5


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
def test_greedy_ids_qwen3_next_three_ring_ranks_and_balanced():
    """Qwen3-Next (fused projections) at U1xR3, a longer prompt at U1xR3 for both other families, a one-token
    prompt, and the balanced layout."""
    cases = [
        ("qwen3_next U1xR3", "qwen3_next", 1, 3, 29, 6),
        ("qwen3_5 U1xR3", "qwen3_5", 1, 3, 40, 6),
        ("nemotron_h U1xR3", "nemotron_h", 1, 3, 40, 6),
        ("qwen3_5 U1xR3 one-token prompt", "qwen3_5", 1, 3, 1, 4),
        ("nemotron_h U1xR3 balanced", "nemotron_h", 1, 3, 23, 4, "balanced"),
    ]
    _check(run_distributed(generation_errors, 3, cases, timeout=400)[0])
