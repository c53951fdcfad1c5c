"""Hybrid linear-attention HF models (Qwen3.5 text, Qwen3-Next: Gated DeltaNet; Nemotron-H: Mamba-2) switched onto
U x R meshes over gloo ranks, against the unmodified model on one process run per document: logits, loss and
every parameter gradient in fp32 within a relative 1e-4 (the kernels compute in fp32; chunk boundaries differ)."""

from __future__ import annotations

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.workers.linear import cases_worker

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-4
PACKED = ((20, 1, 3, 14, 10), (30, 18))  # B = 2, a 1-token and a 3-token document, rows differ
WHOLE = ((48,), (48,))


def _check(found: dict, sensitive: tuple[str, ...] = ()) -> None:
    for name, (error, what) in found.items():
        if name in sensitive:
            assert error > 0.05, f"{name}: the unmodified mixers per shard should be wrong, worst {what} {error:.2e}"
        else:
            assert error < TOLERANCE, f"{name}: worst {what} relative error {error:.2e}"


def test_four_ranks_every_family_and_mesh():
    """U2xR2 for each family (zigzag: two runs per slot, packed rows); U1xR2, U2xR1 (Qwen3.5, Nemotron-H) and the
    balanced layout (DP = 2); and, as a control, the same U2xR2 case with the unmodified mixers, which must be wrong."""
    cases = [
        ("qwen3_5 U2xR2 packed", "qwen3_5", 2, 2, PACKED, "zigzag", True),
        ("qwen3_5 U1xR2 packed", "qwen3_5", 1, 2, PACKED, "zigzag", True),
        ("qwen3_5 U2xR1 whole", "qwen3_5", 2, 1, WHOLE, "zigzag", True),
        ("qwen3_5 U1xR2 balanced", "qwen3_5", 1, 2, PACKED, "balanced", True),
        ("nemotron_h U2xR2 packed", "nemotron_h", 2, 2, PACKED, "zigzag", True),
        ("nemotron_h U1xR2 packed", "nemotron_h", 1, 2, PACKED, "zigzag", True),
        ("nemotron_h U2xR1 whole", "nemotron_h", 2, 1, WHOLE, "zigzag", True),
        ("qwen3_next U2xR2 packed", "qwen3_next", 2, 2, PACKED, "zigzag", True),
        ("control: unswitched mixers", "qwen3_5", 2, 2, PACKED, "zigzag", False),
    ]
    _check(run_distributed(cases_worker, 4, cases, timeout=400)[0], sensitive=("control: unswitched mixers",))


@pytest.mark.slow
def test_three_ring_ranks():
    """An odd ring degree: R = 3 (zigzag: six runs), packed and whole rows, both mixer kinds."""
    cases = [
        ("qwen3_5 U1xR3 packed", "qwen3_5", 1, 3, PACKED, "zigzag", True),
        ("qwen3_5 U1xR3 whole", "qwen3_5", 1, 3, WHOLE, "zigzag", True),
        ("nemotron_h U1xR3 packed", "nemotron_h", 1, 3, PACKED, "zigzag", True),
    ]
    _check(run_distributed(cases_worker, 3, cases, timeout=400)[0])


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_exactly():
    """Every layer recomputed in backward (the state passing's collectives run again, in the same order on
    every rank): U2xR2 packed, both mixer kinds."""
    cases = [
        ("qwen3_5 U2xR2 checkpointed", "qwen3_5", 2, 2, PACKED, "zigzag", True, True),
        ("nemotron_h U2xR2 checkpointed", "nemotron_h", 2, 2, PACKED, "zigzag", True, True),
    ]
    _check(run_distributed(cases_worker, 4, cases, timeout=400)[0])


@pytest.fixture(scope="module")
def plain_trainer():
    from tests.helpers.workers.linear import train_hybrid_model

    return run_distributed(train_hybrid_model, 1, "qwen3_5", None, timeout=400)[0]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_trainer_u2xr2_packed_trains_like_the_plain_trainer(plain_trainer, stage):
    """HybridSPTrainer at U2xR2 (ZeRO-1, 2, 3), rows of two packed documents, against the plain Trainer on one
    process with one document per row: per-step loss and grad_norm (4 steps, accumulation 2) within 1e-3."""
    from tests.helpers.workers.linear import train_hybrid_model

    ours = run_distributed(train_hybrid_model, 4, "qwen3_5", {"ulysses": 2, "ring": 2, "stage": stage}, timeout=600)[0]
    assert ours["step"] == plain_trainer["step"] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert torch.allclose(torch.tensor(ours[key]), torch.tensor(plain_trainer[key]), rtol=1e-3, atol=0), (
            key,
            ours[key],
            plain_trainer[key],
        )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_bf16_within_twice_the_single_process_error(family):
    """bf16 at U2xR2, packed rows: the logits' error against the fp32 model is at most about twice the error of
    the bf16 model on one process (both run per document)."""
    from tests.helpers.workers.linear import bf16_errors

    found = run_distributed(bf16_errors, 4, family, 2, 2, PACKED, timeout=400)[0]
    assert found["sharded"] <= 2 * found["single"] + 1e-3, found
