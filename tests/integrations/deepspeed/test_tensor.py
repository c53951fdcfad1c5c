"""DeepSpeed ZeRO 1, 2 and 3 with tensor parallelism x hybrid sequence parallelism, 4 gloo ranks.

A tiny GQA Llama is trained 3 steps (SGD) by ``hybridsp.integrations.deepspeed.initialize`` with
``tensor=2`` on ``T2 x U2 x R1`` (Megatron-style sequence parallelism inside the tensor group on)
and ``T2 x U1 x R2`` (DeepSpeed's ``"tensor_parallel": {"autotp_size": 2}`` key), and by plain
PyTorch in one process on the full batch. Every step's loss and every parameter's reduced
gradient (this rank's shard of it, as ZeRO holds it) must equal the reference's (relative 1e-4),
and so must the parameters after the last step.
"""

import os

import pytest
import torch
import torch.distributed as dist

from hybridsp import shard_batch, sharded_cross_entropy
from hybridsp.testing import run_distributed
from tests.helpers.models.switched import PAD, build, expected_of, make_batch, shard_of
from tests.helpers.references.attention import rel_err

pytestmark = pytest.mark.integration

STEPS, LR, TOLERANCE = 3, 0.5, 1e-4
BATCHES = [make_batch(64, (64, 56), seed=step) for step in range(STEPS)]
MESHES = {  # name -> hybridsp section, extra top-level config
    "T2xU2xR1+SP": ({"ulysses": 2, "ring": 1, "tensor": 2, "tensor_sequence_parallel": True}, {}),
    "T2xU1xR2": ({"ulysses": 1, "ring": 2}, {"tensor_parallel": {"autotp_size": 2}}),
}


def _config(stage: int, section: dict, extra: dict) -> dict:
    return {
        "hybridsp": {**section, "backend": "torch"},
        **extra,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def _sgd(params):
    """SGD: its update is proportional to the gradient, so a gradient scale error shows in the parameters
    (Adam's sign-like steps would amplify rounding in near-zero gradient elements instead)."""
    return torch.optim.SGD(params, lr=LR)


def reference_run():
    """Per step (loss, {name: grad}) and the final {name: param} of plain single-process training."""
    model = build("llama", num_key_value_heads=2)
    optimizer = _sgd(model.parameters())
    steps = []
    for batch in BATCHES:
        optimizer.zero_grad(set_to_none=True)
        _, loss, grads = expected_of(model, batch)
        steps.append((loss, grads))
        optimizer.step()
    return steps, {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine_errors(stage, section, extra, reference):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from hybridsp.integrations import deepspeed as hds
    from hybridsp.tensor_parallel._model_split import tensor_plan

    steps, final = reference
    model = build("llama", num_key_value_heads=2)
    engine, _, mesh, _ = hds.initialize(model, _config(stage, section, extra), optimizer=_sgd)
    split = tensor_plan(engine.module).split_dims
    worst = {}
    for batch, (ref_loss, ref_grads) in zip(BATCHES, steps):
        local = shard_batch(batch, mesh, pad_token_id=PAD)
        logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        loss = sharded_cross_entropy(logits, local["shift_labels"], mesh)
        engine.backward(loss)
        errors = {"loss": rel_err(loss.detach(), ref_loss)}
        for name, param in engine.module.named_parameters():
            errors[f"grad {name}"] = rel_err(
                safe_get_full_grad(param), shard_of(ref_grads[name], split.get(name), mesh)
            )
        engine.step()
        for key, value in errors.items():
            worst[key] = max(worst.get(key, 0.0), value)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        for name, param in engine.module.named_parameters():
            worst[f"param {name}"] = rel_err(param.detach(), shard_of(final[name], split.get(name), mesh))
    partition = dist.get_world_size(engine.optimizer.dp_process_group)
    return worst, partition


def _check(rank, world, tmp, stages, meshes):
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(tmp, f"ext{rank}")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    reference = reference_run()
    failures = []
    for name in meshes:
        for stage in stages:
            worst, partition = _engine_errors(stage, *MESHES[name], reference)
            key = max(worst, key=worst.get)
            if worst[key] > TOLERANCE:
                failures.append(f"{name} ZeRO-{stage}: {key} {worst[key]:.2e}")
            if partition != 2:
                failures.append(f"{name} ZeRO-{stage}: ZeRO partitions over {partition} ranks, not DP x C = 2")
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_zero_1_2_3_with_tensor_and_sequence_parallelism_equal_single_process_training(tmp_path):
    run_distributed(_check, 4, str(tmp_path), (1, 2, 3), ["T2xU2xR1+SP"], timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_1_2_3_with_autotp_size_key_on_t2u1r2_equal_single_process_training(tmp_path):
    run_distributed(_check, 4, str(tmp_path), (1, 2, 3), ["T2xU1xR2"], timeout=600)


def test_whole_weight_optimizers_and_disagreeing_autotp_sizes_are_refused_and_clipping_is_accepted():
    from hybridsp.integrations import deepspeed as hds

    section = {"ulysses": 1, "ring": 1, "tensor": 2}
    hybrid = hds.HybridConfig.from_ds_config({"hybridsp": section})
    assert hds.deepspeed_config({"gradient_clipping": 0.5}, hybrid)["gradient_clipping"] == 0.5  # test_tensor_norm
    with pytest.raises(ValueError, match="autotp_size=4 disagrees with the hybridsp section's tensor=2"):
        hds.HybridConfig.from_ds_config({"hybridsp": section, "tensor_parallel": {"autotp_size": 4}})
    assert hds.HybridConfig.from_ds_config({"tensor_parallel": {"autotp_size": 2}}).tensor == 2
    model = build("llama", num_key_value_heads=2)
    with pytest.raises(ValueError, match="pass optimizer=lambda params"):
        hds.initialize(
            model, {"hybridsp": section, "gradient_clipping": 0}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
        )
