"""examples/fsdp2_torchrun.py under torchrun against the unmodified model in one process: per-step losses,
gradient norms and the clipped SGD step agree, and every parameter really is a DTensor shard.

The reference is the example's ``--reference`` run (plain transformers and torch, no hybridsp import),
executed here in the test process. Default run: one launch (Qwen3-MoE with its router loss, U1 x R2,
DP 2); ``slow``: Llama, Qwen3-MoE and the Qwen3.5-style linear hybrid at U2xR1, U1xR2, U2xR2 with DP 1 and 2.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

EXAMPLE = ROOT / "examples" / "fsdp2_torchrun.py"
COMMON = [
    "--steps",
    "2",
    "--batch",
    "2",
    "--seq-len",
    "24",
    "--optimizer",
    "sgd",
    "--lr",
    "0.5",
    "--max-grad-norm",
    "1.0",
]


def _example():
    spec = importlib.util.spec_from_file_location("fsdp2_torchrun", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sharded(tmp_path, family: str, ulysses: int, ring: int, dp: int) -> dict:
    out = tmp_path / f"{family}-{ulysses}-{ring}-{dp}.pt"
    world = ulysses * ring * dp
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    args = [str(EXAMPLE), "--family", family, "--ulysses", str(ulysses), "--ring", str(ring), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command + args + COMMON, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every parameter a DTensor shard" in result.stdout and ": True" in result.stdout, result.stdout
    return torch.load(out)


def _check(tmp_path, family: str, ulysses: int, ring: int, dp: int) -> None:
    example = _example()
    expected = example.train_reference(example.parse_args(["--family", family, "--dp", str(dp), *COMMON]))
    got = _sharded(tmp_path, family, ulysses, ring, dp)
    assert got["sharded"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(expected["grad_norms"]), rtol=2e-5, atol=0)
    assert all(norm > 1.0 for norm in expected["grad_norms"][:1]), "the first step must clip"
    assert got["params"].keys() == expected["params"].keys()
    for name, param in expected["params"].items():
        torch.testing.assert_close(got["params"][name], param, rtol=1e-4, atol=2e-5, msg=name)


def test_moe_router_loss_on_a_ring_with_two_replicas(tmp_path):
    _check(tmp_path, "qwen3_moe", 1, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_5"])
@pytest.mark.parametrize(("ulysses", "ring", "dp"), [(2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)])
def test_the_matrix(tmp_path, family, ulysses, ring, dp):
    _check(tmp_path, family, ulysses, ring, dp)
