"""TRL's GRPO and RLOO trainers under hybrid SP against the plain trainers, same seed and weights.

The references are TRL's ``GRPOTrainer`` / ``RLOOTrainer`` without DeepSpeed or sequence
parallelism on one process (and on two, for the data-parallel case): tiny Llama saved and
loaded from disk (TRL builds the reference model from that path), fp32, micro batch 4 of 2
prompts x ``num_generations=2``, completions of at most 10 tokens sampled at temperature 1, two
plain-python reward functions, ``beta=0.1``, 3 optimizer steps, ``max_grad_norm=1.0``. Ours:
``HybridGRPOTrainer`` / ``HybridRLOOTrainer`` at U2 x R1 (2 ranks) and, in the slow set, U2 x R2
(4 ranks), U1 x R3 (3 ranks) and DP2 x U2 (4 ranks, against a plain 2-process run), ZeRO-2 (and
ZeRO-3), on the same prompts; with ``"generation": "sharded"`` (hybridsp's sharded generation
makes the completions, seeded sampling) at U2 x R1 by default and U2 x R2, U1 x R3 in the slow set. Every context rank must have scored the very
completions the plain run sampled (token for token), and the per-step logged ``loss``,
``grad_norm``, ``kl``, ``reward``, ``reward_std``, ``entropy``, clip ratio, completion length and
per-function rewards must agree to relative 1e-4 (absolute 1e-6 near 0; measured: 1e-6).
"""

import pytest
import torch

pytest.importorskip("trl", reason="TRL is optional: pip install -e '.[trl]' (the test extra installs it)")
pytest.importorskip("peft", reason="PEFT is optional: pip install -e '.[trl]' (the test extra installs it)")

from hybridsp.testing import run_distributed  # noqa: E402
from tests.helpers.preload import preload  # noqa: E402
from tests.helpers.workers.trl_rl import LOGGED, several  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

preload("transformers.trainer", "accelerate", "trl", "datasets", "peft")

RTOL, ATOL = 1e-4, 1e-6
U2R1 = {"ulysses": 2, "ring": 1, "stage": 2}
U2R2 = {"ulysses": 2, "ring": 2, "stage": 2}
# name -> (options, world size of ours, degrees, plain world size = the replicas)
CASES = {  # the default run: one representative case, and the same with sharded generation
    "grpo-dapo-U2xR1-zero2": ({"item": "grpo"}, 2, U2R1, 1),
    "grpo-dapo-sharded-generation-U2xR1-zero2": ({"item": "grpo"}, 2, {**U2R1, "generation": "sharded"}, 1),
}
U1R2_FSDP2 = {"ulysses": 1, "ring": 2, "stage": "fsdp2"}  # FSDP2 asked of the trainer: it shards over the mesh
SLOW_CASES = {
    "grpo-dapo-U1xR2-fsdp2": ({"item": "grpo"}, 2, U1R2_FSDP2, 1),
    "grpo-dapo-sharded-generation-U1xR2-fsdp2": ({"item": "grpo"}, 2, {**U1R2_FSDP2, "generation": "sharded"}, 1),
    "rloo-U1xR2-fsdp2": ({"item": "rloo"}, 2, U1R2_FSDP2, 1),
    "rloo-U2xR1-zero2": ({"item": "rloo"}, 2, U2R1, 1),
    "grpo-grpo-U2xR2-zero2": ({"item": "grpo", "loss_type": "grpo"}, 4, U2R2, 1),
    "grpo-dr_grpo-U2xR2-zero2": ({"item": "grpo", "loss_type": "dr_grpo"}, 4, U2R2, 1),
    "grpo-bnpo-U2xR2-zero2": ({"item": "grpo", "loss_type": "bnpo"}, 4, U2R2, 1),
    "grpo-dapo-iterations-accumulation-U2xR2-zero2": (
        {"item": "grpo", "num_iterations": 2, "accumulation": 2},
        4,
        U2R2,
        1,
    ),
    "grpo-dapo-U2xR2-zero3": ({"item": "grpo"}, 4, {**U2R2, "stage": 3}, 1),
    "grpo-lora-U2xR1-zero2": ({"item": "grpo", "peft": True}, 2, U2R1, 1),
    "grpo-checkpointing-U2xR1-zero2": ({"item": "grpo", "checkpointing": True}, 2, U2R1, 1),
    "grpo-dapo-DP2xU2xR1-zero2": ({"item": "grpo", "accumulation": 2}, 4, U2R1, 2),
    "rloo-U2xR2-zero2": ({"item": "rloo"}, 4, U2R2, 1),
    "grpo-dapo-U1xR3-zero2": ({"item": "grpo"}, 3, {"ulysses": 1, "ring": 3, "stage": 2}, 1),  # an odd degree
    "grpo-dapo-sharded-generation-U2xR2-zero3": ({"item": "grpo"}, 4, {**U2R2, "stage": 3, "generation": "sharded"}, 1),
    "rloo-sharded-generation-U2xR2-zero2": ({"item": "rloo"}, 4, {**U2R2, "generation": "sharded"}, 1),
    "grpo-lora-sharded-generation-U2xR1-zero2": (
        {"item": "grpo", "peft": True},
        2,
        {**U2R1, "generation": "sharded"},
        1,
    ),
    "grpo-dapo-sharded-generation-U1xR3-zero2": (
        {"item": "grpo"},
        3,
        {"ulysses": 1, "ring": 3, "stage": 2, "generation": "sharded"},
        1,
    ),
}


def _key(options: dict, world: int) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(options.items())) + f",world={world}"


def _run(cases: dict) -> tuple[dict, dict]:
    """(ours by name: every rank's result, plain by options key: every rank's result); one launch per world."""
    plain_runs = {_key(options, world): (options, world) for options, _, _, world in cases.values()}
    plain = {}
    for world in sorted({world for _, world in plain_runs.values()}):
        keys = [key for key, (_, w) in plain_runs.items() if w == world]
        results = run_distributed(several, world, [{**plain_runs[k][0], "hybrid": None} for k in keys], timeout=900)
        plain.update({key: [rank[i] for rank in results] for i, key in enumerate(keys)})
    ours = {}
    # one launch per world size and sharding kind: accelerate's state outlives a trainer in its process
    launches = sorted({(world, degrees["stage"] == "fsdp2") for _, world, degrees, _ in cases.values()})
    for world, fsdp2 in launches:
        names = [n for n, (_, w, d, _) in cases.items() if w == world and (d["stage"] == "fsdp2") == fsdp2]
        runs = [{**cases[name][0], "hybrid": cases[name][2]} for name in names]
        results = run_distributed(several, world, runs, timeout=900)
        ours.update({name: [rank[i] for rank in results] for i, name in enumerate(names)})
    return ours, plain


def _close(ours: list, reference: list) -> bool:
    """Within ATOL + RTOL |reference| per step; None (a step that logs no such metric) on both sides alike."""
    if [value is None for value in ours] != [value is None for value in reference]:
        return False
    pairs = [(a, b) for a, b in zip(ours, reference) if b is not None]
    ours, reference = (torch.tensor(side, dtype=torch.float64) for side in zip(*pairs))
    return bool(((ours - reference).abs() <= ATOL + RTOL * reference.abs()).all())


def _check(name: str, ours: list, plain: list, cases: dict) -> None:
    """Each of our ranks against the plain process of its replica (ranks dp * C ... dp * C + C - 1)."""
    _, world, degrees, replicas = cases[name]
    context = degrees["ulysses"] * degrees["ring"]
    assert world == replicas * context
    for rank, result in enumerate(ours):
        reference = plain[rank // context]
        assert result["step"] == reference["step"] == [1, 2, 3], (name, rank, result["step"])
        assert result["completions"] == reference["completions"], f"{name} rank {rank}: other completions"
        for key in LOGGED:
            assert _close(result[key], reference[key]), f"{name} rank {rank} {key}: {result[key]} vs {reference[key]}"
    sharded = degrees.get("generation") == "sharded"
    assert all((result["sharded_generations"] > 0) == sharded for result in ours), name  # the path under test ran
    if degrees["stage"] == "fsdp2":
        assert all(result["fully_sharded"] for result in ours), f"{name}: a parameter is not a DTensor shard"
    first = plain[0]
    assert first["grad_norm"][0] > 0 and first["kl"][2] != 0  # the runs did train, the KL term is live


@pytest.fixture(scope="module")
def default_runs():
    return _run(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_hybrid_grpo_and_rloo_match_the_plain_trainers(default_runs, name):
    ours, plain = default_runs
    _check(name, ours[name], plain[_key(CASES[name][0], CASES[name][3])], CASES)


@pytest.mark.slow
def test_more_grpo_and_rloo_cases_match_the_plain_trainers():
    ours, plain = _run(SLOW_CASES)
    for name, (options, _, _, replicas) in SLOW_CASES.items():
        _check(name, ours[name], plain[_key(options, replicas)], SLOW_CASES)
