"""torch.compile through the two engines users train with, against the same engine in eager.

- ``hybridsp.integrations.deepspeed.initialize`` with ``"compile": {"enabled": true, "backend":
  "aot_eager"}`` in the DeepSpeed config (U2xR2, ZeRO-2, fp32, 4 gloo ranks; the section's plumbing
  and the capture, without inductor's C++ build): three packed steps; losses and DeepSpeed's gradient
  norms must equal an uncompiled engine's (relative 1e-5), with one graph and no recompilation.
- ``HybridSPTrainer`` with ``TrainingArguments(torch_compile=True)`` (slow: inductor compiles the
  Trainer's model on 4 ranks in about 90 s): the logged losses and gradient norms of 4 steps must
  equal the uncompiled Trainer's (relative 1e-5).
"""

import os
import tempfile

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.packs import packed_lm_batch
from tests.helpers.preload import preload

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

preload("transformers.trainer", "accelerate")
TOLERANCE = 1e-5
STEPS = 3


def _config(compiled: bool) -> dict:
    config = {
        "hybridsp": {"ulysses": 2, "ring": 2},
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    return {**config, "compile": {"enabled": True, "backend": "aot_eager"}} if compiled else config


def _deepspeed_run(compiled: bool) -> dict:
    from hybridsp import shard_batch, sharded_cross_entropy
    from hybridsp.integrations.deepspeed import initialize, without_cpu_shm_comm_build
    from tests.helpers.families import PAD, build_family

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with without_cpu_shm_comm_build():
        engine, _, mesh, _ = initialize(build_family("llama"), _config(compiled))
    losses, norms = [], []
    for step in range(STEPS):
        local = shard_batch(packed_lm_batch(step, 64), mesh, pad_token_id=PAD)
        out = engine(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            hybridsp_documents=local["documents"],
            use_cache=False,
        )
        loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return {
        "losses": losses,
        "norms": norms,
        "compiled": engine.is_compiled,
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(counters["recompiles"].values()),
    }


def _deepspeed_both(rank, world):
    return [_deepspeed_run(True), _deepspeed_run(False)]


def _close(ours, theirs) -> bool:
    ours, theirs = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
    return bool(torch.allclose(ours, theirs, rtol=TOLERANCE, atol=0))


def test_deepspeed_compile_config_compiles_the_engine_and_trains_as_eager():
    for compiled, eager in run_distributed(_deepspeed_both, 4, timeout=900):
        assert compiled["compiled"] and not eager["compiled"]
        assert (compiled["graphs"], compiled["recompiles"]) == (1, 0), compiled
        assert _close(compiled["losses"], eager["losses"]), (compiled["losses"], eager["losses"])
        assert _close(compiled["norms"], eager["norms"]), (compiled["norms"], eager["norms"])


def _trainer_run(compiled: bool) -> dict | None:
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from tests.helpers.workers import trainer as trainer_workers

    os.environ["OMP_NUM_THREADS"] = "1"
    torch._dynamo.reset()
    train = trainer_workers.samples(40, seed=1)
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        trainer = trainer_workers.make_trainer(
            out, dict(ulysses=2, ring=2, stage=2), train, None, torch_compile=compiled
        )
        trainer.train()
    return trainer_workers.step_logs(trainer)


def _trainer_both(rank, world):
    return [_trainer_run(True), _trainer_run(False)]


@pytest.mark.slow
def test_trainer_torch_compile_trains_as_eager():
    compiled, eager = run_distributed(_trainer_both, 4, timeout=1200)[0]
    assert compiled["step"] == eager["step"] == [1, 2, 3, 4]
    assert _close(compiled["loss"], eager["loss"]), (compiled, eager)
    assert _close(compiled["grad_norm"], eager["grad_norm"]), (compiled, eager)
