"""The MoE router load-balancing loss under sequence parallelism against the plain trainers and the unmodified model.

Tiny Qwen3-MoE and Mixtral (4 experts, top-2, 2 layers; tests/helpers/families.py) with
``output_router_logits=True`` and ``router_aux_loss_coef=0.05``. ``HybridSPTrainer`` at U2 x R2 (4 gloo
ranks, ZeRO-2) against the plain ``Trainer`` on one process, the same data (right-padded rows of 17-40
tokens: ``shard_batch`` pads, the ``attention_mask`` excludes padding), micro batch 2, gradient
accumulation 2, 3 SGD steps, ``max_grad_norm=1.0``: per-step ``loss`` and ``grad_norm``, ``eval_loss`` and
the change of every parameter over the 3 steps. The router (gate) weights are the real check: measured
at Qwen3-MoE, a per-shard loss averaged over the context ranks (what a model computes on its shard)
moves the logged loss visibly only through its value, but the routers' updates by 10-20 % relative,
and leaving the loss out entirely by ~100 %; ours agree to ~1e-6. ``causal_lm_loss`` runs in the same
launch against ``model(**batch).loss``. Slow: Mixtral, ``HybridSFTTrainer`` against TRL's ``SFTTrainer``
(also its logged ``aux_loss``), and DP2 x U2 against the plain Trainer on 2 DDP processes.
"""

import sys
import types

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
from tests.helpers.preload import preload
from tests.helpers.workers.moe import ROUTER_COEF, moe_model, several

pytestmark = pytest.mark.integration

preload("transformers.trainer", "accelerate")

RTOL = 1e-4  # loss, grad_norm, eval_loss (measured: ~1e-7)
ROUTER_RTOL = 1e-4  # relative error of the routers' updates (measured ~1e-6; a per-shard loss: 0.1-0.2)
UPDATE_RTOL = 1e-3  # every other parameter's update (measured at most 1e-4, a q_norm's small update)
U2R2 = {"ulysses": 2, "ring": 2, "stage": 2}


def _trained(family, item="trainer"):
    return dict(item=item, family=family, hybrid=None), dict(item=item, family=family, hybrid=U2R2)


def _launch(cases):
    """(plain results on one process, ours at U2 x R2) for a list of (plain, ours) case pairs; a
    ``causal_lm_loss`` case runs with ours only."""
    plain = [pair[0] for pair in cases if pair[0] is not None]
    plain = iter(run_distributed(several, 1, plain, timeout=600)[0] if plain else [])
    ours = run_distributed(several, 4, [pair[1] for pair in cases], timeout=900)[0]
    return [(next(plain) if pair[0] is not None else None, result) for pair, result in zip(cases, ours)]


@pytest.fixture(scope="module")
def qwen3_moe():
    check = (None, dict(item="causal_lm_loss", family="qwen3_moe", ulysses=2, ring=2))
    return _launch([_trained("qwen3_moe"), check])


def _close(ours, reference, what, rtol=RTOL):
    ours, reference = torch.tensor(ours, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    assert torch.allclose(ours, reference, rtol=rtol, atol=0), (
        f"{what}: ours {ours.tolist()} vs plain {reference.tolist()}"
    )


def _compare_training(plain, ours, family):
    assert ours["step"] == plain["step"] == [1, 2, 3]
    _close(ours["loss"], plain["loss"], f"{family} loss")
    _close(ours["grad_norm"], plain["grad_norm"], f"{family} grad_norm")
    _close([ours["eval_loss"]], [plain["eval_loss"]], f"{family} eval_loss")
    errors = {
        name: (
            (torch.tensor(ours["updates"][name]) - torch.tensor(update)).abs().max() / torch.tensor(update).abs().max()
        ).item()
        for name, update in plain["updates"].items()
    }
    routers = {name: error for name, error in errors.items() if name.endswith("mlp.gate.weight")}
    assert len(routers) == 2 and max(routers.values()) < ROUTER_RTOL, f"{family} router updates: {routers}"
    assert max(errors.values()) < UPDATE_RTOL, f"{family} updates: {errors}"


@pytest.mark.distributed
def test_hybrid_trainer_matches_the_plain_trainer_qwen3_moe(qwen3_moe):
    plain, ours = qwen3_moe[0]
    _compare_training(plain, ours, "qwen3_moe")


@pytest.mark.distributed
def test_causal_lm_loss_matches_the_model_loss_qwen3_moe(qwen3_moe):
    result = qwen3_moe[1][1]
    _close([result["loss"]], [result["expected"]], "causal_lm_loss")
    assert max(result["errors"].values()) < 1e-4, result["errors"]


@pytest.fixture(scope="module")
def slow_runs():
    check = (None, dict(item="causal_lm_loss", family="mixtral", ulysses=2, ring=2))
    return _launch([_trained("mixtral"), _trained("qwen3_moe", item="sft"), check])


@pytest.mark.distributed
@pytest.mark.slow
def test_hybrid_trainer_matches_the_plain_trainer_mixtral(slow_runs):
    plain, ours = slow_runs[0]
    _compare_training(plain, ours, "mixtral")


@pytest.mark.distributed
@pytest.mark.slow
def test_hybrid_sft_trainer_adds_the_router_loss_as_trl(slow_runs):
    plain, ours = slow_runs[1]
    _compare_training(plain, ours, "qwen3_moe sft")
    assert None not in plain["aux_loss"], "TRL logged no aux_loss: the router loss was off"
    _close(ours["aux_loss"], plain["aux_loss"], "sft aux_loss")


@pytest.mark.distributed
@pytest.mark.slow
def test_causal_lm_loss_matches_the_model_loss_mixtral(slow_runs):
    result = slow_runs[2][1]
    _close([result["loss"]], [result["expected"]], "causal_lm_loss")
    assert max(result["errors"].values()) < 1e-4, result["errors"]


@pytest.mark.distributed
@pytest.mark.slow
def test_replicas_add_it_as_the_plain_ddp_trainer():
    """DP2 x U2 (ZeRO-2) against the plain Trainer on 2 DDP processes: the Trainer multiplies the model's
    loss, router term included, by its processes, so the router gradients are the sum of the replicas'."""
    case = dict(item="trainer", family="qwen3_moe")
    plain = run_distributed(several, 2, [dict(case, hybrid=None)], timeout=600)[0][0]
    ours = run_distributed(several, 4, [dict(case, hybrid={"ulysses": 2, "ring": 1, "stage": 2})], timeout=900)[0][0]
    _compare_training(plain, ours, "qwen3_moe DP2")


# ---- which models add which router loss (one process, no communication) -------------------------


def test_the_router_loss_read_from_the_model():
    from hybridsp.integrations.transformers import model_router_loss

    for family in ("qwen3_moe", "mixtral"):
        router = model_router_loss(moe_model(family))
        assert (router.coefficient, router.num_experts, router.top_k) == (ROUTER_COEF, 4, 2)
        model = moe_model(family)
        model.config.output_router_logits = False  # the model's own loss adds nothing then
        assert model_router_loss(model) is None
        assert model_router_loss(model, coefficient=0.3).coefficient == 0.3  # TRL's coefficient wins
        assert model_router_loss(model, coefficient=0.0) is None


def test_models_without_a_router_loss_need_nothing():
    from hybridsp.integrations.transformers import model_router_loss
    from tests.helpers.families import build_family

    assert model_router_loss(build_family("deepseek_v3", output_router_logits=True)) is None  # bias-balanced
    assert model_router_loss(build_family("llama")) is None


def test_another_router_loss_is_refused(monkeypatch):
    from hybridsp.integrations.transformers import model_router_loss

    module = types.ModuleType("other_moe")
    module.load_balancing_loss_func = lambda logits, experts, top_k, mask=None: torch.tensor(1.0)  # not ours
    monkeypatch.setitem(sys.modules, "other_moe", module)
    model = moe_model("qwen3_moe")
    other = type("OtherMoeForCausalLM", (type(model),), {"__module__": "other_moe"})
    model.__class__ = other
    with pytest.raises(ValueError, match="OtherMoeForCausalLM has no router loss that hybridsp shards"):
        model_router_loss(model)


def test_causal_lm_loss_without_the_token_mask_is_refused():
    from hybridsp.integrations.transformers import causal_lm_loss

    local = {key: torch.zeros(1, 8, dtype=torch.long) for key in ("input_ids", "position_ids", "shift_labels")}
    with pytest.raises(ValueError, match=r"pass token_mask=hybridsp.real_token_mask"):
        causal_lm_loss(moe_model("mixtral"), local, mesh_at(2, 2))  # before the forward (no process groups)
