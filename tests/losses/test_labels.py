"""Issue 21's small edges: a bias on some MLP projections, int32 labels, one bad label in the Trainer,
string sizes in a DeepSpeed config, zero and infinite planner numbers, the pins that must agree."""

from __future__ import annotations

import configparser
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridsp
from hybridsp import apply_tiled_mlp, init_mesh
from hybridsp.integrations.deepspeed import HybridConfig
from hybridsp.testing import run_distributed
from tests.helpers.paths import ROOT
from tests.helpers.reference import rel_err

# --------------------------------------------------------------------------- tiled MLP with some biases


class _GatedMLP(nn.Module):
    def __init__(self, biases: tuple[bool, bool, bool]):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 20, bias=biases[0]), nn.Linear(8, 20, bias=biases[1])
        self.down_proj, self.act_fn = nn.Linear(20, 8, bias=biases[2]), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("biases", [(False, False, True), (True, False, False), (True, True, False), (True,) * 3])
def test_tiled_mlp_keeps_every_bias_that_exists(biases):
    torch.manual_seed(0)
    mlp = _GatedMLP(biases)
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        if linear.bias is not None:
            nn.init.normal_(linear.bias)  # far from 0, so a dropped bias shows
    x = torch.randn(2, 11, 8, requires_grad=True)
    grad = torch.randn(2, 11, 8)
    expected = mlp(x)
    expected_grads = torch.autograd.grad(expected, [x, *mlp.parameters()], grad)
    with apply_tiled_mlp(mlp, tile_tokens=4):
        actual = mlp(x)
        actual_grads = torch.autograd.grad(actual, [x, *mlp.parameters()], grad)
    assert rel_err(actual, expected) < 1e-6
    assert max(rel_err(a, e) for a, e in zip(actual_grads, expected_grads)) < 1e-5


# --------------------------------------------------------------------------- labels


def _int32_labels(rank, world):
    mesh = init_mesh(1, world)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 12, 4, generator=gen), torch.randn(9, 4, generator=gen)
    labels = torch.randint(0, 9, (2, 12), generator=gen)
    labels[0, :3] = -100
    full_loss = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=-100)
    local = slice(rank * 6, (rank + 1) * 6)  # contiguous halves: what the loss sees does not depend on layout
    h, lab = hidden[:, local], labels[:, local].to(torch.int32)
    return (float(hybridsp.sharded_cross_entropy(h @ weight.T, lab, mesh)),
            float(hybridsp.fused_cross_entropy(h, weight, lab, mesh)), float(full_loss))


def _labels_worker(rank, world):
    return {"int32": _int32_labels(rank, world), "trainer": _trainer_with_a_bad_label(rank, world)}


@pytest.fixture(scope="module")
def labels():
    return run_distributed(_labels_worker, 2, timeout=240)


def test_int32_labels_give_the_int64_loss(labels):
    for result in labels:
        sharded, fused, expected = result["int32"]
        assert abs(sharded - expected) < 1e-5 * abs(expected) and abs(fused - expected) < 1e-5 * abs(expected)


def _trainer_with_a_bad_label(rank, world):
    """A U2 HybridSPTrainer (no DeepSpeed); the batch's one bad label lands on context rank 1 only."""
    import tempfile

    from hybridsp.integrations.transformers import HybridSPTrainer
    from tests.helpers.trainer_workers import VOCAB, _arguments, tiny_llama

    ids = torch.randint(1, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 8] = VOCAB + 5  # zigzag over 2 ranks: token 8 lives on rank 1
    inputs = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    messages = {}
    with tempfile.TemporaryDirectory() as out:
        trainer = HybridSPTrainer(model=tiny_llama(), args=_arguments(out, None), hybridsp={"ulysses": 2})
        for name, count in (("compute_loss", torch.tensor(15.0)), ("count", None)):
            try:
                trainer.compute_loss(trainer.model, inputs, num_items_in_batch=count)
                messages[name] = None
            except ValueError as error:
                messages[name] = str(error)
    return messages


def test_trainer_bad_label_on_one_rank_is_an_error_on_every_rank(labels):
    for result in labels:
        for name, message in result["trainer"].items():
            assert message and "outside the vocabulary [0, 64)" in message, (name, message)


# --------------------------------------------------------------------------- configs and the planner


@pytest.mark.parametrize("config, message", [
    ({"hybridsp": {"ulysses": 2, "ring": 2}, "sequence_parallel_size": "4"},
     "sequence_parallel_size must be a positive integer; got '4' (str)"),
    ({"hybridsp": {"ulysses": 2}, "data_parallel_size": 2.0}, "data_parallel_size must be a positive integer; got 2.0"),
    ({"hybridsp": {"ulysses": 2}, "sequence_parallel_size": True}, "got True (bool)"),
])
def test_config_sizes_must_be_json_numbers(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        HybridConfig.from_ds_config(config)


@pytest.mark.parametrize("option, value", [
    ("--memory-gib", "0"), ("--heads", "0"), ("--head-dim", "0"), ("--vocab", "0"), ("--layers", "0"),
    ("--host-memory-gib", "0"), ("--flops", "inf"), ("--flops", "nan"), ("--seq-len", "-8"), ("--nodes", "0"),
])
def test_plan_refuses_zero_and_infinite_numbers(capsys, option, value):
    from hybridsp.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama3-8b", "--seq-len", "8192", option, value])
    assert exit_info.value.code == 2
    assert f"argument {option}: expected a positive" in capsys.readouterr().err


def test_declared_transformers_pin_is_the_code_pin():
    from hybridsp.integrations.transformers import MIN_TRANSFORMERS_VERSION

    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    pins = [line.strip() for line in parser["options"]["install_requires"].splitlines() if "transformers" in line]
    assert pins == [f"transformers>={MIN_TRANSFORMERS_VERSION.removesuffix('.0')}"], pins


def test_plan_needs_head_dim_when_heads_do_not_divide_hidden(capsys):
    from hybridsp.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--seq-len", "8192", "--heads", "8", "--hidden", "500", "--intermediate", "1024", "--layers",
              "2", "--vocab", "100"])
    assert "--hidden 500 is not a multiple of --heads 8: give --head-dim" in str(exit_info.value)


def _replica_with_a_bad_label(rank, world):
    """DP 2 x U 2: only replica 1's batch has a bad label; the step's count (one all-reduce over the
    replicas) makes every rank of both replicas raise before the forward."""
    import tempfile

    from hybridsp.integrations.transformers import HybridSPTrainer
    from tests.helpers.trainer_workers import VOCAB, _arguments, tiny_llama

    with tempfile.TemporaryDirectory() as out:
        trainer = HybridSPTrainer(model=tiny_llama(), args=_arguments(out, None), hybridsp={"ulysses": 2})
        ids = torch.randint(1, VOCAB, (1, 16), generator=torch.Generator().manual_seed(trainer.hybrid_mesh.dp_rank))
        labels = ids.clone()
        if trainer.hybrid_mesh.dp_rank == 1:
            labels[0, 3] = -7
        try:
            trainer.compute_loss(trainer.model, {"input_ids": ids, "labels": labels})
        except ValueError as error:
            return str(error)
    return None


@pytest.mark.slow
def test_trainer_bad_label_on_one_replica_is_an_error_on_every_replica():
    for message in run_distributed(_replica_with_a_bad_label, 4, timeout=300):
        assert message and "1 target id(s) in shift_labels lie outside the vocabulary [0, 64)" in message, message
