"""The exactness probe (``hybridsp.verify_parity``) on tiny switched models: clean runs pass in fp32 and bf16
(no false alarm over seeds, meshes, GQA, padding, packed documents, windows), and each injected fault is caught
at the right layer and rank (tests/helpers/workers/parity.py injects them). The reference is float64 attention
math on the gathered q/k/v, independent of every kernel and transport."""

from __future__ import annotations

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.workers.parity import FAULT_RANK, FAULTS, NAN_LAYER, probe_cases

pytestmark = [pytest.mark.distributed, pytest.mark.integration]


def _same_on_every_rank(results: list[dict]) -> dict:
    for other in results[1:]:
        assert other == results[0]
    return results[0]


def test_clean_fp32_passes_and_every_fault_is_caught_where_it_happens():
    found = _same_on_every_rank(run_distributed(probe_cases, 4, 2, 2, "qwen2", torch.float32, (0,), tuple(FAULTS)))
    ok, layer, quantity, rank, error, table = found["clean0"]
    assert ok and error < 1e-5, table
    expected = {  # fault -> (layer, quantity, rank); None: any
        "wrong_kernel": (0, "out", FAULT_RANK),  # the first layer, on the rank with the wrong kernel
        "nan_on_rank": (NAN_LAYER, "out", FAULT_RANK),  # where the NaN first appears
        "stale_block": (0, "out", FAULT_RANK),  # the rank that read the stale block
        "double_permutation": (0, "out", None),  # positions out of order: every rank
        "local_denominator": (None, "loss", None),  # the loss itself, layers fine
    }
    for fault, (want_layer, want_quantity, want_rank) in expected.items():
        ok, layer, quantity, rank, error, table = found[fault]
        assert not ok, f"{fault} went unnoticed:\n{table}"
        assert (layer, quantity) == (want_layer, want_quantity), f"{fault}:\n{table}"
        assert want_rank is None or rank == want_rank, f"{fault}:\n{table}"
    assert found["local_denominator"][4] > 1.0  # the loss off by the context degree's order


def test_clean_bf16_on_an_odd_ring_with_gqa_and_a_window_passes():
    found = _same_on_every_rank(
        run_distributed(probe_cases, 3, 1, 3, "mistral", torch.bfloat16, (0, 1), (), dict(sliding_window=20))
    )
    for seed in (0, 1):
        ok, *_, table = found[f"clean{seed}"]
        assert ok, table


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("ulysses", "ring", "family"), [(2, 2, "qwen3"), (1, 4, "llama"), (2, 1, "qwen2")])
def test_no_false_alarm_over_seeds(ulysses, ring, family, dtype):
    found = _same_on_every_rank(
        run_distributed(
            probe_cases, ulysses * ring, ulysses, ring, family, dtype, (0, 1, 2, 3, 4), (), None, (64, (64, 37))
        )
    )
    for case, (ok, *_, table) in found.items():
        assert ok, f"{case}:\n{table}"
