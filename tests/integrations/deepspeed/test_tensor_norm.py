"""The gradient norm DeepSpeed reports and clips with under tensor parallelism is the whole model's.

Reference: a tiny GQA Llama trained 3 steps by plain PyTorch in one process on the full batch,
``torch.nn.utils.clip_grad_norm_`` at 0.05 (it clips every step: the norms are about 1.2) and SGD.
Against it, :func:`hybridsp.integrations.deepspeed.initialize` with ``tensor=2`` and
``"gradient_clipping": 0.05``: per step ``engine.get_global_grad_norm()`` (ZeRO 1-3; stage 0 with
a torch optimizer reports none) must equal the reference's pre-clip norm (relative 1e-4), every
parameter after the 3 steps (this rank's shard) the reference's (1e-4), and every parameter's
change over the steps the reference's change (1e-3). SGD's change is ``-lr x clip coefficient x
gradient``, so a wrong norm shows in it directly: counting only this tensor rank's shards (the
norm before the fix) gives norms 7% too small here and changes 7% too large. The change
tolerance is looser because a change is a difference of float32 weights and the tensor-parallel
layer-norm gradients are summed in another order (their max error is about 1e-4 of their max on
their own).
"""

import os

import pytest
import torch

from hybridsp import shard_batch, sharded_cross_entropy
from hybridsp.testing import run_distributed
from tests.helpers.models.switched import PAD, build, make_batch, shard_of
from tests.helpers.references.attention import rel_err

pytestmark = pytest.mark.integration

STEPS, LR, CLIP = 3, 5.0, 0.05
TOLERANCE = {"grad": 1e-4, "param": 1e-4, "change": 1e-3}  # by the first word of an error key; see the docstring
BATCHES = [make_batch(64, (64, 64), seed=step) for step in range(STEPS)]  # equal rows: DP replicas average exactly
MESHES = {  # name -> hybridsp section (world = T x U x R x DP)
    "T2+SP": {"ulysses": 1, "ring": 1, "tensor": 2, "tensor_sequence_parallel": True},  # world 2
    "T2xU2+SP": {"ulysses": 2, "ring": 1, "tensor": 2, "tensor_sequence_parallel": True},  # world 4
    "T2xR2": {"ulysses": 1, "ring": 2, "tensor": 2},  # world 4
    "T2xDP2": {"ulysses": 1, "ring": 1, "tensor": 2},  # world 4: two replicas, one row each
}


def _model():
    return build("llama", num_key_value_heads=2)


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def reference_run():
    """([pre-clip grad norm per step], {name: parameter change over the steps}) of plain training."""
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _sgd(model.parameters())
    norms = []
    for batch in BATCHES:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    assert min(norms) > 10 * CLIP, f"the reference norms {norms} must be clipped for the test to mean anything"
    return norms, {n: p.detach() - start[n] for n, p in model.named_parameters()}


def _config(stage: int, section: dict, micro: int) -> dict:
    return {
        "hybridsp": {**section, "backend": "torch"},
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def _replica_rows(batch: dict, mesh) -> dict:
    """This DP replica's rows of the full batch."""
    rows = batch["input_ids"].shape[0] // mesh.dp
    return {k: v[mesh.dp_rank * rows : (mesh.dp_rank + 1) * rows] for k, v in batch.items()}


def _engine_errors(stage: int, section: dict, reference) -> dict[str, float]:
    """{what: worst relative error} of one ``initialize`` run against the reference."""
    import deepspeed

    from hybridsp.integrations import deepspeed as hds
    from hybridsp.tensor_parallel._model_split import tensor_plan

    ref_norms, ref_change = reference
    model = _model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}  # before the split: full tensors
    dp = torch.distributed.get_world_size() // (2 * section["ulysses"] * section["ring"])
    engine, _, mesh, undo = hds.initialize(model, _config(stage, section, 2 // dp), optimizer=_sgd)
    split = tensor_plan(engine.module).split_dims
    errors = {}
    for step, batch in enumerate(BATCHES):
        local = shard_batch(_replica_rows(batch, mesh), mesh, pad_token_id=PAD)
        logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        engine.backward(sharded_cross_entropy(logits, local["shift_labels"], mesh))
        engine.step()
        if stage > 0:
            norm = engine.get_global_grad_norm()
            errors[f"grad norm step {step}"] = abs(float(norm) - ref_norms[step]) / ref_norms[step]
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        for name, param in engine.module.named_parameters():
            dim = split.get(name)
            change = param.detach() - shard_of(start[name], dim, mesh)
            errors[f"change {name}"] = rel_err(change, shard_of(ref_change[name], dim, mesh))
            errors[f"param {name}"] = rel_err(param.detach(), shard_of(start[name] + ref_change[name], dim, mesh))
    undo()
    return errors


def _check(rank, world, tmp, stages, meshes):
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(tmp, f"ext{rank}")
    reference = reference_run()
    failures = []
    for name in meshes:
        for stage in stages:
            errors = _engine_errors(stage, MESHES[name], reference)
            failures += [
                f"{name} ZeRO-{stage}: {key} rel err {value:.2e}"
                for key, value in errors.items()
                if value > TOLERANCE[key.split()[0]]
            ]
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_grad_norm_and_clipping_with_tensor_2_equal_single_process_training_zero_0_to_3(tmp_path):
    run_distributed(_check, 2, str(tmp_path), (0, 1, 2, 3), ["T2+SP"], timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_grad_norm_and_clipping_with_tensor_2_and_context_2_equal_single_process_training(tmp_path):
    run_distributed(_check, 4, str(tmp_path), (1, 2, 3), ["T2xU2+SP", "T2xR2"], timeout=900)


@pytest.mark.distributed
@pytest.mark.slow
def test_grad_norm_and_clipping_with_tensor_2_and_two_replicas_equal_single_process_training(tmp_path):
    run_distributed(_check, 4, str(tmp_path), (0, 1, 2, 3), ["T2xDP2"], timeout=600)


def test_count_tensor_shards_in_norm_sets_the_zero_attributes_undoably_and_refuses_an_unknown_optimizer():
    from types import SimpleNamespace

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from hybridsp.integrations.deepspeed._tensor import count_tensor_shards_in_norm

    def fake(kind, **attributes):
        """An instance of DeepSpeed's optimizer class ``kind`` holding only ``attributes``."""
        optimizer = kind.__new__(kind)
        optimizer.__dict__.update(attributes)
        return optimizer

    mesh = SimpleNamespace(tensor=2, tensor_group="<tensor group>", tensor_rank=1)
    zero = fake(DeepSpeedZeroOptimizer, model_parallel_group=None, model_parallel_rank=0, model_parallel_world_size=1)
    undo = count_tensor_shards_in_norm(zero, mesh, 2)
    assert vars(zero) == {
        "model_parallel_group": "<tensor group>",
        "model_parallel_rank": 1,
        "model_parallel_world_size": 2,
    }
    undo()
    assert vars(zero) == {"model_parallel_group": None, "model_parallel_rank": 0, "model_parallel_world_size": 1}
    count_tensor_shards_in_norm(SimpleNamespace(), mesh, 0)()  # stage 0: DeepSpeed asks the mpu
    count_tensor_shards_in_norm(None, mesh, 3)()  # ZeRO-3 without an optimizer: no norm
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    asks_the_mpu = fake(BF16_Optimizer, mpu="<mpu>")  # the bf16 optimizer sums over the mpu's group itself
    count_tensor_shards_in_norm(asks_the_mpu, mesh, 1)()
    assert vars(asks_the_mpu) == {"mpu": "<mpu>"}
    with pytest.raises(RuntimeError, match=r"\(ZeRO stage 3\) has no model_parallel_group.*tensor=2"):
        count_tensor_shards_in_norm(fake(DeepSpeedZeroOptimizer_Stage3), mesh, 3)
