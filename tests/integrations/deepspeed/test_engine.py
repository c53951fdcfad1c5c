"""DeepSpeed ZeRO 0-3 composed with hybrid sequence parallelism, on 4 gloo ranks (fp32, CPU).

A tiny Llama is trained for 5 steps from the same seed on the same global batch (4 right-padded
sequences of 64 tokens, gradient clipping at a norm every step exceeds) by:

- the reference: DeepSpeed without sequence parallelism, pure DP over the 4 ranks, at the
  same ZeRO stage (and that reference against a single-process PyTorch run, to show it is
  fair: same loss, gradient norm, gradients and parameters);
- ``hybridsp.integrations.deepspeed.initialize`` on ``ds_configs/cp4.json`` (U=2 x R=2) and
  ``ds_configs/cp2.json`` (DP=2 x U=2 x R=1, micro batch 1 x 2 accumulation steps).

At every step the loss, every parameter's reduced gradient (as ZeRO holds it) and the
gradient norm DeepSpeed reports must equal the reference's (relative 1e-4), and so must the
parameter update at the end. Each run is saved at step 3; a fresh engine on a differently
initialised model loads it and must repeat steps 4-5. A negative control shows what the
ZeRO-3 gradient hook fixes (Note [gradient scale] in the module).

Everything runs in one 4-rank launch shared by the tests (engines build in about a second;
processes that import DeepSpeed and transformers do not). Each rank compares in place and
returns only error numbers.
"""

import itertools
import os

import pytest
import torch
import torch.distributed as dist

from hybridsp.testing import run_distributed
from tests.helpers.deepspeed_engines import flat, forbid_jit_builds, full_grads, full_params
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

WORLD, SEQ, VOCAB, PAD, PADDED = 4, 64, 128, 0, 8  # every sequence ends in PADDED padding tokens
STEPS, SAVE_AFTER, CLIP, LR, SEED = 5, 3, 0.5, 1e-3, 0
TOLERANCE = 1e-4
STAGES = (0, 1, 2, 3)
MESHES = {  # name -> (config file, micro batch per rank, accumulation steps); global batch 4 everywhere
    "U2xR2": ("cp4.json", 4, 1),
    "DP2xU2xR1": ("cp2.json", 1, 2),
}


def _model(seed: int = SEED):
    from tests.helpers.models.tiny import tiny_causal_lm

    return tiny_causal_lm(
        "llama",
        seed=seed,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )


def _batches() -> list[dict]:
    """STEPS full batches: input_ids/labels [4, SEQ], the last PADDED tokens of each row padding."""
    gen = torch.Generator().manual_seed(1)
    mask = (torch.arange(SEQ) < SEQ - PADDED).long().expand(WORLD, SEQ)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (WORLD, SEQ), generator=gen).masked_fill(mask == 0, PAD)
        batches.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": mask.clone()})
    return batches


def _rows(batch: dict, first: int, count: int) -> dict:
    return {key: value[first : first + count] for key, value in batch.items()}


def _stage0_norm(engine) -> float | None:
    """Stage 0 in fp32 reports no norm: the one DeepSpeed's own clip function computes with this mpu."""
    if engine.zero_optimization_stage() != 0:
        return None
    from deepspeed.runtime.utils import clip_grad_norm_

    return float(clip_grad_norm_(list(engine.module.parameters()), max_norm=float("inf"), mpu=engine.mpu))


def _partition_size(engine) -> int | None:
    """Ranks ZeRO partitions over (for ZeRO-3: the smallest parameter partition group)."""
    if engine.zero_optimization_stage() == 0:
        return None
    size = dist.get_world_size(engine.optimizer.dp_process_group)
    if engine.zero_optimization_stage() == 3:
        size = min([size] + [dist.get_world_size(p.ds_process_group) for p in engine.module.parameters()])
    return size


def _world_mean(value: torch.Tensor) -> float:
    total = value.detach().double().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


class Trace:
    """Per step: global loss, DeepSpeed's gradient norm, full gradient; the final parameters."""

    def __init__(self):
        self.losses, self.norms, self.grads, self.params = [], [], [], None
        self.partition = self.batch_size = None


def _train(engine, batches, steps, micro, accumulation, local_loss, save=None) -> Trace:
    """Run ``steps``; ``local_loss(batch, first, count)`` is this rank's loss on rows first..first+count-1.

    ``save=(dir, tag)`` checkpoints after step SAVE_AFTER.
    """
    trace = Trace()
    replica = engine.mpu.mesh.dp_rank if engine.mpu is not None else dist.get_rank()
    for step in steps:
        losses = []
        for index in range(accumulation):
            loss = local_loss(batches[step], (replica * accumulation + index) * micro, micro)
            engine.backward(loss)
            losses.append(loss.detach())
            if index == accumulation - 1:
                trace.grads.append(full_grads(engine))
                norm = _stage0_norm(engine)
            engine.step()
        trace.losses.append(_world_mean(torch.stack(losses).mean()))
        trace.norms.append(float(engine.get_global_grad_norm() if norm is None else norm))
        if save is not None and step + 1 == SAVE_AFTER:
            engine.save_checkpoint(save[0], tag=save[1])
    trace.params = full_params(engine)
    return trace


def _reference_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def _train_without_sp(stage: int, batches) -> Trace:
    """The reference: plain HF model, DeepSpeed without an mpu, one sequence per rank."""
    import deepspeed

    model = _model()
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
        config=_reference_config(stage),
        model_parameters=model.parameters(),
    )
    trace = _train(engine, batches, range(STEPS), 1, 1, lambda batch, first, n: engine(**_hf(batch, first, n)).loss)
    trace.partition = _partition_size(engine)
    return trace


def _hf(batch, first, count):
    """Arguments of the unmodified HF model for rows first..first+count: its own mask, shift and mean."""
    rows = _rows(batch, first, count)
    return {
        "input_ids": rows["input_ids"],
        "attention_mask": rows["attention_mask"],
        "use_cache": False,
        "labels": rows["labels"].masked_fill(rows["attention_mask"] == 0, -100),
    }


def _train_plain_pytorch(batches) -> Trace:
    """One process, the whole batch, torch's own clipping: the ground truth for the reference."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    trace = Trace()
    for batch in batches:
        loss = model(**_hf(batch, 0, WORLD)).loss
        loss.backward()
        trace.grads.append(flat(p.grad for p in model.parameters()))
        trace.norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trace.losses.append(loss.item())
    trace.params = flat(model.parameters())
    return trace


def _sp_config(name: str, stage: int) -> dict:
    """A shipped config with the test's batch, clipping and stage; the client AdamW replaces its optimizer."""
    from hybridsp.integrations.deepspeed import load_config

    config = load_config(ROOT / "ds_configs" / MESHES[name][0])
    config.pop("optimizer")
    zero = {**config["zero_optimization"], "stage": stage, "stage3_param_persistence_threshold": 0}
    return {
        **config,
        "train_micro_batch_size_per_gpu": MESHES[name][1],
        "gradient_accumulation_steps": MESHES[name][2],
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }


def _train_with_sp(name: str, stage: int, batches, steps, seed=SEED, save=None, load=None) -> Trace:
    """``hybridsp.integrations.deepspeed.initialize`` on the HF model; optionally save or load (dir, tag)."""
    from hybridsp import shard_batch, sharded_cross_entropy
    from hybridsp.integrations import deepspeed as hds

    model = _model(seed)
    engine, _, mesh, _ = hds.initialize(
        model, _sp_config(name, stage), optimizer=torch.optim.AdamW(model.parameters(), lr=LR)
    )
    if load is not None:
        path, _ = engine.load_checkpoint(load[0], tag=load[1])
        assert path is not None, f"no checkpoint {load}"

    def local_loss(batch, first, count):
        local = shard_batch(_rows(batch, first, count), mesh, pad_token_id=PAD)
        logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        return sharded_cross_entropy(logits, local["shift_labels"], mesh)

    trace = _train(engine, batches, steps, MESHES[name][1], MESHES[name][2], local_loss, save)
    trace.partition, trace.batch_size = _partition_size(engine), engine.train_batch_size()
    return trace


def _zero3_without_hook(batches) -> tuple[float, torch.Tensor]:
    """ZeRO-3 with only the mpu (no gradient hook): (reported norm, full gradient) after one step."""
    import deepspeed

    from hybridsp import shard_batch, sharded_cross_entropy
    from hybridsp.integrations import deepspeed as hds
    from hybridsp.integrations.transformers import apply

    model = _model()
    hybrid = hds.HybridConfig.from_ds_config(_sp_config("U2xR2", 3))
    mesh = hds.build_mesh(hybrid)
    apply(model, mesh)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
        model_parameters=model.parameters(),
        config=hds.deepspeed_config(_sp_config("U2xR2", 3), hybrid),
        mpu=hds.HybridMPU(mesh),
    )
    local = shard_batch(batches[0], mesh, pad_token_id=PAD)
    logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    engine.backward(sharded_cross_entropy(logits, local["shift_labels"], mesh))
    grads = full_grads(engine)
    engine.step()
    return float(engine.get_global_grad_norm()), grads


def _rel(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).norm() / expected.norm()).item()


def _per_step(actual, expected) -> list[float]:
    return [_rel(a, e) for a, e in zip(actual, expected)]


def _compare(run: Trace, ref: Trace, start: torch.Tensor, steps=range(STEPS)) -> dict:
    """Relative errors per step (loss, norm, gradient) and of the parameter update at the end."""
    losses, norms, grads = (list(values[i] for i in steps) for values in (ref.losses, ref.norms, ref.grads))
    return {
        "loss": _per_step(run.losses, losses),
        "norm": _per_step(run.norms, norms),
        "grad": _per_step(run.grads, grads),
        "update": _rel(run.params - start, ref.params - start),
        "params": _rel(run.params, ref.params),
    }


def _train_everything(rank, world, checkpoints):
    torch.set_num_threads(1)
    extensions = forbid_jit_builds(checkpoints)
    batches, start = _batches(), flat(_model().parameters())
    # References first: DeepSpeed keeps the last engine's mpu in a module global that an engine
    # built without one inherits (deepspeed/utils/groups.py).
    references = {stage: _train_without_sp(stage, batches) for stage in STAGES}
    plain = _train_plain_pytorch(batches)
    out = {
        "reference": {
            stage: {**_compare(ref, plain, start), "partition": ref.partition, "norms": ref.norms, "losses": ref.losses}
            for stage, ref in references.items()
        },
        "sp": {},
        "resumed": {},
    }
    for name, stage in itertools.product(MESHES, STAGES):
        tag = f"{name}-zero{stage}"
        run = _train_with_sp(name, stage, batches, range(STEPS), save=(checkpoints, tag))
        out["sp"][tag] = {
            **_compare(run, references[stage], start),
            "partition": run.partition,
            "batch_size": run.batch_size,
            "norms": run.norms,
        }
        resumed = _train_with_sp(name, stage, batches, range(SAVE_AFTER, STEPS), seed=SEED + 1, load=(checkpoints, tag))
        out["resumed"][tag] = _compare(resumed, run, start, range(SAVE_AFTER, STEPS))
    norm, grads = _zero3_without_hook(batches)
    out["no_hook"] = {
        "norm_ratio": norm / references[3].norms[0],
        "grad_ratio": (grads.norm() / references[3].grads[0].norm()).item(),
        "grad_x4": _rel(grads * 4, references[3].grads[0]),
    }
    out["jit_built"] = os.path.exists(extensions)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Rank 0's error numbers of the whole launch (every rank compares the same global values)."""
    return run_distributed(_train_everything, WORLD, str(tmp_path_factory.mktemp("ds")), timeout=600)[0]


def _worst(errors: dict) -> dict:
    return {
        key: max(value) if isinstance(value, list) else value
        for key, value in errors.items()
        if key in ("loss", "norm", "grad", "update", "params")
    }


def test_reference_equals_single_process_pytorch(runs):
    for stage, errors in runs["reference"].items():
        assert max(_worst(errors).values()) < TOLERANCE, (stage, errors)
        assert errors["partition"] in (None, WORLD), (stage, errors["partition"])
        assert min(errors["norms"]) > 1.5 * CLIP, f"clipping must act at every step: norms {errors['norms']}"


@pytest.mark.parametrize("name,stage", list(itertools.product(MESHES, STAGES)))
def test_zero_stage_with_sequence_parallelism_equals_reference(runs, name, stage):
    errors = runs["sp"][f"{name}-zero{stage}"]
    assert max(_worst(errors).values()) < TOLERANCE, _worst(errors)
    assert errors["batch_size"] == WORLD  # DeepSpeed counts replicas, not ranks: micro x accumulation x DP
    assert errors["partition"] == (None if stage == 0 else WORLD)  # ZeRO shards over DP x context ranks


@pytest.mark.parametrize("name,stage", list(itertools.product(MESHES, STAGES)))
def test_resume_at_step_3_repeats_steps_4_and_5(runs, name, stage):
    errors = runs["resumed"][f"{name}-zero{stage}"]
    assert max(_worst(errors).values()) < 1e-6, _worst(errors)


def test_zero3_needs_the_gradient_hook(runs):
    """Without it, ZeRO-3's reduce-scatter averages over all DP x C ranks: gradients and norm are 1/C."""
    control = runs["no_hook"]
    assert abs(control["grad_ratio"] - 0.25) < 1e-4 and abs(control["norm_ratio"] - 0.25) < 1e-4, control
    assert control["grad_x4"] < TOLERANCE, control


def test_nothing_was_jit_compiled(runs):
    assert not runs["jit_built"]
