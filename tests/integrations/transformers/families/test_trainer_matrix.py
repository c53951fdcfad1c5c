"""HybridSPTrainer at U2xR2 (4 gloo ranks, ZeRO-2) on the families the table marks for it beyond the ones with their
own Trainer tests (Llama: test_trainer.py; Qwen3-MoE, Mixtral: test_router_loss.py): per-step loss and grad norm equal
the plain Trainer on one process, and so does every trained parameter (tests/helpers/families.py)."""

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.families import families_where
from tests.helpers.workers.moe import several

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

OWN_TESTS = ("llama", "qwen3_moe", "mixtral")
DEFAULT = ("gpt_oss", "deepseek_v3")  # sinks + MoE router loss, MLA: the rest of the table runs in the slow set
TOLERANCE = 1e-4


def _compare(names) -> None:
    assert names, "the table marks none of these families for the Trainer: nothing to compare"
    cases = [dict(item="trainer", family=name, hybrid=None) for name in names]
    plain = run_distributed(several, 1, cases, timeout=900)[0]
    ours = run_distributed(
        several, 4, [dict(case, hybrid=dict(ulysses=2, ring=2, stage=2)) for case in cases], timeout=900
    )[0]
    assert len(plain) == len(ours) == len(names), (len(plain), len(ours), names)  # zip below would stop short
    failures = []
    for name, reference, result in zip(names, plain, ours):
        for key in ("loss", "grad_norm"):
            if not torch.allclose(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=TOLERANCE, atol=1e-6):
                failures.append(f"{name} {key}: {result[key]} vs {reference[key]}")
        for param, update in reference["updates"].items():
            got, want = torch.tensor(result["updates"][param]), torch.tensor(update)
            if (got - want).abs().max() > TOLERANCE * want.abs().max().item() + 1e-6:  # fp32 rounding of tiny updates
                failures.append(f"{name} update of {param}: {(got - want).abs().max().item():.2e}")
    assert not failures, "\n".join(failures[:10])


def test_trainer_on_sinks_moe_and_mla_families_equals_the_plain_trainer():
    _compare([name for name in DEFAULT if name in families_where("trainer")])


@pytest.mark.slow
def test_trainer_on_every_other_family_equals_the_plain_trainer():
    _compare([name for name in families_where("trainer") if name not in OWN_TESTS + DEFAULT])
