"""HybridSPTrainer against the plain Hugging Face Trainer (tiny Llama, fp32, gloo on CPU).

The reference is ``transformers.Trainer`` without DeepSpeed and without sequence parallelism,
on one process (or two, DP=2), with the same global batch: micro batch 2, gradient
accumulation 2, 4 optimizer steps, ``max_grad_norm=1.0`` (the first steps' norms exceed it, so
clipping acts), right-padded rows of 17-40 tokens with unlabelled prefixes (micro-batches and
replicas hold different token counts, so a loss that is not weighted by the global count
would show). ``HybridSPTrainer`` runs on 4 ranks as U2 x R2 under ZeRO-2 (DeepSpeed's own
AdamW, torch implementation) and ZeRO-3 (the Trainer's AdamW), and as DP2 x U2 x R1 under
ZeRO-1 against the plain Trainer on 2 ranks. Per-step logged ``loss`` and ``grad_norm``,
``evaluate()``'s ``eval_loss`` (5 samples: a short last batch) and ``predict()``'s logits
must agree (relative 1e-3; measured: about 1e-5). Adam hides a constant gradient scale, the
logged and clipped norm does not: a run whose gradients were C times off fails here.

The three hybrid runs share one 4-rank launch; the references one launch each.
"""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.preload import preload
from tests.helpers.workers.trainer import save_and_resume, several

pytestmark = pytest.mark.integration

# The workers import the Trainer and accelerate; the forkserver imports them once (if it starts here).
preload("transformers.trainer", "accelerate")

RTOL = 1e-3
HYBRID_RUNS = {
    "U2xR2-zero2": dict(ulysses=2, ring=2, stage=2, config_optimizer=True),
    "U2xR2-zero3": dict(ulysses=2, ring=2, stage=3),
    "DP2xU2xR1-zero1": dict(ulysses=2, ring=1, stage=1),
}
REFERENCE_WORLD = {"U2xR2-zero2": 1, "U2xR2-zero3": 1, "DP2xU2xR1-zero1": 2}


@pytest.fixture(scope="module")
def hybrid():
    results = run_distributed(several, 4, list(HYBRID_RUNS.values()), timeout=600)[0]
    return dict(zip(HYBRID_RUNS, results))


@pytest.fixture(scope="module")
def plain():
    return {world: run_distributed(several, world, [None], timeout=300)[0][0] for world in (1, 2)}


def _assert_close(ours, reference, what):
    ours, reference = torch.tensor(ours, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    ratio = ours / reference
    assert torch.allclose(ours, reference, rtol=RTOL, atol=0), (
        f"{what}: ours {ours.tolist()} vs plain {reference.tolist()} (ratio {ratio.tolist()})"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(HYBRID_RUNS))
def test_steps_match_the_plain_trainer(hybrid, plain, name):
    ours, reference = hybrid[name], plain[REFERENCE_WORLD[name]]
    assert ours["step"] == reference["step"] == [1, 2, 3, 4]
    _assert_close(ours["loss"], reference["loss"], f"{name} loss")
    _assert_close(ours["grad_norm"], reference["grad_norm"], f"{name} grad_norm")


@pytest.mark.distributed
def test_clipping_is_exercised(plain):
    assert max(plain[1]["grad_norm"]) > 1.0, "the reference never clips; the test would not see a wrong clip"


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(HYBRID_RUNS))
def test_sharded_evaluation_equals_unsharded(hybrid, plain, name):
    ours, reference = hybrid[name], plain[REFERENCE_WORLD[name]]
    _assert_close([ours["eval_loss"]], [reference["eval_loss"]], f"{name} eval_loss")
    labels, reference_labels = torch.tensor(ours["label_ids"]), torch.tensor(reference["label_ids"])
    assert torch.equal(labels, reference_labels)
    logits, reference_logits = torch.tensor(ours["predictions"]), torch.tensor(reference["predictions"])
    assert logits.shape == reference_logits.shape  # [5, S_max, V]: every sample once, full sequence
    real = labels != -100  # labelled tokens (padding and the cross-batch padding are -100)
    torch.testing.assert_close(logits[real], reference_logits[real], rtol=RTOL, atol=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_without_deepspeed_matches_plain_trainer(plain):
    ours = run_distributed(several, 4, [dict(ulysses=2, ring=1, stage=None)], timeout=300)[0][0]
    _assert_close(ours["loss"], plain[2]["loss"], "DDP loss")
    _assert_close(ours["grad_norm"], plain[2]["grad_norm"], "DDP grad_norm")
    _assert_close([ours["eval_loss"]], [plain[2]["eval_loss"]], "DDP eval_loss")


@pytest.mark.distributed
@pytest.mark.slow
def test_odd_ring_of_three_matches_plain_trainer(plain):
    ours = run_distributed(several, 3, [dict(ulysses=1, ring=3, stage=2)], timeout=300)[0][0]
    _assert_close(ours["loss"], plain[1]["loss"], "R3 loss")
    _assert_close(ours["grad_norm"], plain[1]["grad_norm"], "R3 grad_norm")
    _assert_close([ours["eval_loss"]], [plain[1]["eval_loss"]], "R3 eval_loss")


@pytest.mark.distributed
@pytest.mark.slow
def test_save_and_resume_repeat_the_run():
    with tempfile.TemporaryDirectory() as out:
        result = run_distributed(save_and_resume, 4, dict(ulysses=2, ring=2, stage=3), out, timeout=400)[0]
    first, resumed = result["first"], result["resumed"]
    assert resumed["step"] == first["step"] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's history
    _assert_close(resumed["loss"][2:], first["loss"][2:], "resumed loss")
    _assert_close(resumed["grad_norm"][2:], first["grad_norm"][2:], "resumed grad_norm")
    assert "global_step2" in result["files"] and "model.safetensors" in result["files"]
    assert "hybridsp" not in repr(result["config"]), "the saved config must load without hybridsp"


def _single_process_checks(rank, world_size):
    """Bad setups, the engine config and replica loaders, in one process that has the Trainer loaded."""
    return {"refusals": _refusals(), "engine_config": _engine_config_check(), "loaders": _replica_loaders()}


def _refusals():
    """Each bad setup (no DeepSpeed: accelerate allows one DeepSpeed plugin per process)."""
    from hybridsp.integrations.transformers import HybridSPTrainer
    from tests.helpers.workers.trainer import _arguments, tiny_llama

    messages = {}
    with tempfile.TemporaryDirectory() as out:
        for name, kwargs in {
            "degrees": dict(hybridsp={"ulysses": 3}),
            "compute_loss_func": dict(hybridsp={"ulysses": 1}, compute_loss_func=len),
            "label_smoothing": dict(hybridsp={"ulysses": 1}, args=_arguments(out, None, label_smoothing_factor=0.1)),
        }.items():
            try:
                HybridSPTrainer(model=tiny_llama(), **{"args": _arguments(out, None), **kwargs})
            except ValueError as error:
                messages[name] = str(error)
        trainer = HybridSPTrainer(model=tiny_llama(), args=_arguments(out, None), hybridsp={"ulysses": 1})
        try:
            trainer.compute_loss(trainer.model, {"input_ids": torch.ones(1, 8, dtype=torch.long)})
        except ValueError as error:
            messages["labels"] = str(error)
    return messages


def _engine_config_check():
    """What DeepSpeed would be handed for a config with every key we own, on a DP=2 mesh."""
    from types import SimpleNamespace

    from hybridsp.integrations import deepspeed as hds
    from hybridsp.integrations.transformers._trainer import engine_config

    raw = {
        "hybridsp": {"ulysses": 2, "ring": 2},
        "sequence_parallel_size": 4,
        "data_parallel_size": 2,
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 5,
        "train_batch_size": 120,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    cleaned = engine_config(raw, hds.HybridConfig.from_ds_config(raw), SimpleNamespace(dp=2))
    return {"cleaned": cleaned, "raw_after": raw}


def _replica_loaders():
    """Batches each of 4 ranks (C=2, DP=2) gets from accelerate-prepared, re-pointed loaders."""
    from types import SimpleNamespace

    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from hybridsp.integrations.transformers._trainer_data import shard_loader_over_replicas

    world, context, seen = 4, 2, []
    for rank in range(world):
        loader = prepare_data_loader(
            DataLoader(list(range(10)), batch_size=2), num_processes=world, process_index=rank, put_on_device=False
        )
        mesh = SimpleNamespace(context=context, world_size=world, dp=world // context, dp_rank=rank // context)
        seen.append([batch.tolist() for batch in shard_loader_over_replicas(loader, mesh)])
    return seen


@pytest.fixture(scope="module")
def checks():
    return run_distributed(_single_process_checks, 1, timeout=300)[0]


@pytest.mark.distributed
def test_bad_setups_raise_clear_errors(checks):
    messages = checks["refusals"]
    assert "3 context ranks do not divide the world size 1" in messages["degrees"]
    assert "compute_loss_func" in messages["compute_loss_func"]
    assert "label_smoothing_factor" in messages["label_smoothing"]
    assert "needs 'labels'" in messages["labels"]


def test_without_a_process_group_the_error_names_the_one_process_way():
    """Before: it said a DeepSpeed config in TrainingArguments initialises torch.distributed on one process
    (it does not: examples/train_hf_trainer.py failed so)."""
    import torch.distributed as dist

    from hybridsp.integrations.deepspeed import HybridConfig
    from hybridsp.integrations.transformers._trainer import _mesh

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"hybridsp\.launch\.init_process_group\(\) before building the Trainer"):
        _mesh(HybridConfig.from_ds_config({"hybridsp": {"ulysses": 1, "ring": 1}}))


def _tensor_refusals(rank, world_size):
    """HybridSPTrainer with a tensor degree in the DeepSpeed config: refused at construction on every rank."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.transformers import HybridSPTrainer
    from tests.helpers.workers.trainer import _arguments, ds_config, tiny_llama

    messages = {}
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        for name, extra in {"section": {}, "autotp_size": {"tensor_parallel": {"autotp_size": 2}}}.items():
            config = {**ds_config(1, 1, 2, False), "gradient_clipping": 0.0, **extra}
            if name == "section":
                config["hybridsp"] = {"ulysses": 1, "ring": 1, "tensor": 2}
            try:
                HybridSPTrainer(model=tiny_llama(), args=_arguments(out, config, max_grad_norm=0.0))
                messages[name] = None
            except ValueError as error:
                messages[name] = str(error)
    return messages


@pytest.mark.distributed
def test_tensor_parallel_config_is_refused():
    """Before: trained the unsplit weights with both tensor ranks doing the same work, no error."""
    for messages in run_distributed(_tensor_refusals, 2, timeout=300):
        for name, message in messages.items():
            assert message is not None, f"{name}: tensor=2 was accepted"
            assert "no tensor parallelism" in message and "hybridsp.integrations.deepspeed.initialize" in message
            assert "docs/tensor-parallel.md" in message and "\n" not in message


@pytest.mark.distributed
def test_engine_config_strips_our_keys_and_counts_replicas(checks):
    cleaned, raw = checks["engine_config"]["cleaned"], checks["engine_config"]["raw_after"]
    assert not {"hybridsp", "sequence_parallel_size", "data_parallel_size"} & set(cleaned)
    assert cleaned["train_batch_size"] == 3 * 5 * 2  # DP replicas, not the 8 ranks HF's "auto" would count
    if not torch.cuda.is_available():
        assert cleaned["optimizer"]["params"]["torch_adam"] is True
    assert raw["train_batch_size"] == 120 and "hybridsp" in raw  # the caller's dict is not changed


@pytest.mark.distributed
def test_loaders_are_sharded_over_replicas(checks):
    seen = checks["loaders"]
    assert seen[0] == seen[1] and seen[2] == seen[3]  # the context ranks of a replica: the same batches
    assert seen[0] == [[0, 1], [4, 5], [8, 9]] and seen[2] == [[2, 3], [6, 7], [0, 1]]  # a DP=2 run's


def test_importing_the_integration_stays_cheap():
    """The Trainer names resolve lazily (the workers above import and use them); importing the
    integration module loads neither accelerate nor the Trainer."""
    code = (
        "import sys, hybridsp.integrations.transformers as t; "
        "assert 'accelerate' not in sys.modules and 'hybridsp.integrations.transformers._trainer' not in sys.modules; "
        "assert 'transformers.trainer' not in sys.modules; assert {'HybridSPTrainer', 'HybridSPMixin'} <= "
        "set(t.__all__)"
    )
    root = str(ROOT)
    env = {**os.environ, "PYTHONPATH": root}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=root, timeout=120)
