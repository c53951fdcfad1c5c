"""TRL's SFT and DPO trainers and PEFT LoRA under hybrid SP against the plain trainers on one process.

The references are TRL's ``SFTTrainer`` / ``DPOTrainer`` and transformers' ``Trainer`` on one
process without DeepSpeed or sequence parallelism (tiny Llama, fp32, micro batch 2, gradient
accumulation 2, 2 optimizer steps, ``max_grad_norm=1.0``). Ours: ``HybridSFTTrainer``,
``HybridDPOTrainer`` and ``HybridSPTrainer`` on 2 ranks (U2 x R1, ZeRO-2) and 4 ranks (U2 x R2,
ZeRO-3), each on the same data. SFT runs TRL's own dataset preparation on prompt-completion
rows (``completion_only_loss`` by default) and on packed text (``packing=True``: padding-free
rows whose ``position_ids`` restart per document); DPO runs with a separate reference model (and
with PEFT and no reference model, in the slow set). Per-step logged ``loss`` and ``grad_norm``
(and DPO's ``rewards/chosen``, ``rewards/rejected``; SFT's token accuracy, entropy and
``num_tokens``) and ``evaluate()``'s ``eval_loss`` (and DPO's ``eval_rewards/chosen``) must
agree to relative 1e-3 (measured: loss and grad_norm below 1e-6). PEFT runs train only the
LoRA weights and save the same ``adapter_model`` as the plain run.
"""

import pytest
import torch

pytest.importorskip("trl", reason="TRL is optional: pip install -e '.[trl]' (the test extra installs it)")
pytest.importorskip("peft", reason="PEFT is optional: pip install -e '.[trl]' (the test extra installs it)")

from hybridsp.testing import run_distributed  # noqa: E402
from tests.helpers.preload import preload  # noqa: E402
from tests.helpers.workers.trl_sft import several  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

preload("transformers.trainer", "accelerate", "trl", "datasets", "peft")

RTOL = 1e-3
U2R1 = {"ulysses": 2, "ring": 1, "stage": 2}
U2R2 = {"ulysses": 2, "ring": 2, "stage": 3}
U1R2_FSDP2 = {"ulysses": 1, "ring": 2, "stage": "fsdp2"}  # FSDP2 asked of the trainer: it shards over the mesh
U2R2_FSDP2 = {"ulysses": 2, "ring": 2, "stage": "fsdp2"}
# name -> (item options, world size of ours, degrees); each is compared with the plain run of its options
CASES = {
    "sft-packed-U2xR1-zero2": ({"item": "sft", "packing": True}, 2, U2R1),
    "dpo-U2xR1-zero2": ({"item": "dpo"}, 2, U2R1),
    "lora-U2xR1-zero2": ({"item": "lora", "peft": True}, 2, U2R1),
    "sft-lora-U2xR2-zero3": ({"item": "sft", "peft": True}, 4, U2R2),
    "dpo-U2xR2-zero3": ({"item": "dpo"}, 4, U2R2),
    "lora-U2xR2-zero3": ({"item": "lora", "peft": True}, 4, U2R2),
    "sft-packed-U1xR2-fsdp2": ({"item": "sft", "packing": True}, 2, U1R2_FSDP2),
}
SLOW_CASES = {
    "dpo-U2xR2-fsdp2": ({"item": "dpo"}, 4, U2R2_FSDP2),
    "sft-lora-U2xR2-fsdp2": ({"item": "sft", "peft": True}, 4, U2R2_FSDP2),
    "dpo-U1xR2-fsdp2": ({"item": "dpo"}, 2, U1R2_FSDP2),
    "sft-U2xR1-zero2": ({"item": "sft"}, 2, U2R1),
    "sft-dft-U2xR1-zero2": ({"item": "sft", "loss_type": "dft"}, 2, U2R1),
    "sft-lora-U2xR1-zero2": ({"item": "sft", "peft": True}, 2, U2R1),
    "dpo-lora-U2xR1-zero2": ({"item": "dpo", "peft": True}, 2, U2R1),
    "sft-U2xR2-zero3": ({"item": "sft"}, 4, U2R2),
    "sft-packed-U2xR2-zero3": ({"item": "sft", "packing": True}, 4, U2R2),
    "sft-packed-checkpointing-U2xR1-zero2": ({"item": "sft", "packing": True, "checkpointing": True}, 2, U2R1),
    "dpo-lora-U2xR2-zero3": ({"item": "dpo", "peft": True}, 4, U2R2),
    "lora-U2xR2-zero2": ({"item": "lora", "peft": True}, 4, {**U2R2, "stage": 2}),
}


def _key(options: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()))


def _run(cases: dict) -> tuple[dict, dict]:
    """(ours by name, plain by options key): one launch per world size, one plain launch."""
    plain_options = {_key(options): options for options, _, _ in cases.values()}
    plain_results = run_distributed(several, 1, [{**o, "hybrid": None} for o in plain_options.values()], timeout=600)[0]
    ours = {}
    # one launch per world size and sharding kind: accelerate's state outlives a trainer in its process
    launches = sorted({(world, degrees["stage"] == "fsdp2") for _, world, degrees in cases.values()})
    for world, fsdp2 in launches:
        names = [name for name, (_, w, d) in cases.items() if w == world and (d["stage"] == "fsdp2") == fsdp2]
        runs = [{**cases[name][0], "hybrid": cases[name][2]} for name in names]
        ours.update(zip(names, run_distributed(several, world, runs, timeout=900)[0]))
    return ours, dict(zip(plain_options, plain_results))


def worst_relative(ours, reference) -> float:
    """max |ours - reference| / |reference| over entries (reference 0: the absolute difference)."""
    ours, reference = torch.tensor(ours, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    scale = reference.abs().where(reference != 0, torch.ones_like(reference))
    return float(((ours - reference).abs() / scale).max())


def _check(name: str, ours: dict, plain: dict, cases: dict) -> None:
    options = cases[name][0]
    assert ours["step"] == plain["step"] == [1, 2]
    keys = ["loss", "grad_norm"] + {
        "dpo": ["rewards/chosen", "rewards/rejected"],
        "sft": ["mean_token_accuracy", "entropy"],
    }.get(options["item"], [])
    for key in keys:
        assert worst_relative(ours[key], plain[key]) < RTOL, f"{name} {key}: ours {ours[key]} vs plain {plain[key]}"
    if options["item"] in ("sft", "dpo"):
        assert ours["num_tokens"] == plain["num_tokens"], (name, ours["num_tokens"], plain["num_tokens"])
    if options["item"] in ("sft", "dpo"):  # evaluate(): SFT's eval_loss, DPO's eval_loss and rewards
        assert sorted(ours["eval"]) == sorted(plain["eval"])
        for key, value in plain["eval"].items():
            assert worst_relative([ours["eval"][key]], [value]) < RTOL, (name, key, ours["eval"][key], value)
    if options.get("peft"):
        assert ours["trainable"] == plain["trainable"] and all("lora_" in n for n in ours["trainable"])
        assert plain["frozen_unchanged"], "the plain PEFT run changed frozen weights"
        assert sorted(ours["adapter"]) == sorted(plain["adapter"])
        for key, value in plain["adapter"].items():
            torch.testing.assert_close(torch.tensor(ours["adapter"][key]), torch.tensor(value), rtol=RTOL, atol=1e-6)
    assert plain["grad_norm"][0] > 0 and plain["loss"][0] != plain["loss"][1]  # the runs did train
    if cases[name][2]["stage"] == "fsdp2":
        assert ours["fully_sharded"], f"{name}: FSDP2 was asked for and a parameter is not a DTensor shard"


@pytest.fixture(scope="module")
def default_runs():
    return _run(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_trl_and_peft_match_the_plain_trainers(default_runs, name):
    ours, plain = default_runs
    _check(name, ours[name], plain[_key(CASES[name][0])], CASES)


@pytest.mark.slow
def test_more_trl_and_peft_cases_match_the_plain_trainers():
    ours, plain = _run(SLOW_CASES)
    for name in SLOW_CASES:
        _check(name, ours[name], plain[_key(SLOW_CASES[name][0])], SLOW_CASES)


@pytest.mark.slow
def test_packed_sft_on_a_hybrid_linear_model():
    """HybridSFTTrainer with packing on Qwen3.5 (Gated DeltaNet layers, exact state passing) at U2xR2 ZeRO-2
    against the plain SFTTrainer, whose recurrent layers run each packed document by itself."""
    cases = {
        "sft-packed-qwen3_5-U2xR2-zero2": (
            {"item": "sft", "packing": True, "model": "qwen3_5"},
            4,
            {**U2R2, "stage": 2},
        )
    }
    ours, plain = _run(cases)
    for name in cases:
        _check(name, ours[name], plain[_key(cases[name][0])], cases)


def _fused_call_checks(rank, world_size):
    """On one rank (C = 1): a hooked fused call equals TRL's own on the full batch (padding to the layout's
    multiple and the cut back to [B, S - 1] included); bad calls and DPO's precompute are refused."""
    from trl.trainer.utils import add_fused_lm_head

    from hybridsp import init_mesh
    from hybridsp.integrations.transformers import apply
    from hybridsp.integrations.trl._logprobs import shard_fused_calls
    from tests.helpers.workers.trainer import tiny_llama

    model = tiny_llama()
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(1, 64, (2, 13), generator=torch.Generator().manual_seed(0))  # odd length: padded inside
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100
    plain = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    mesh = init_mesh(ulysses=1, ring=1)
    handle = apply(model, mesh)
    remove = shard_fused_calls(model, mesh)
    ours = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    errors = []
    for call in (
        lambda: model(ids, labels=labels, fused_lm_head=True),
        lambda: model(input_ids=ids, labels=labels, token_type_ids=mask, fused_lm_head=True),
    ):
        try:
            call()
        except ValueError as error:
            errors.append(str(error))
    remove()
    handle.undo()
    try:  # refused before TRL's constructor (and its collectives) runs
        from trl import DPOConfig

        from hybridsp.integrations.trl import HybridDPOTrainer

        config = DPOConfig(output_dir="unused", precompute_ref_log_probs=True, report_to=[], bf16=False)
        HybridDPOTrainer(model=model, args=config)
    except ValueError as error:
        errors.append(str(error))
    fields = ("log_probs", "entropy", "is_top1", "label_mask", "loss")
    return {
        "plain": {k: getattr(plain, k).tolist() for k in fields},
        "ours": {k: getattr(ours, k).tolist() for k in fields},
        "errors": errors,
    }


def test_fused_calls_keep_trls_values_and_bad_setups_are_refused():
    result = run_distributed(_fused_call_checks, 1, timeout=300)[0]
    for key, value in result["plain"].items():
        torch.testing.assert_close(torch.tensor(result["ours"][key]), torch.tensor(value), rtol=1e-5, atol=1e-6)
    assert len(result["errors"]) == 3
    assert "keyword arguments only" in result["errors"][0] and "token_type_ids" in result["errors"][1]
    assert "precompute_ref_log_probs" in result["errors"][2]
