"""What HybridSPTrainer refuses about FSDP, in one line before any collective, and how it reads the request."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments

from hybridsp.integrations.transformers import HybridSPTrainer
from tests.helpers.models.tiny import tiny_causal_lm

pytestmark = [pytest.mark.integration]

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)


def _args(tmp_path, **fields) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fields)


def test_fsdp_version_1_is_refused(tmp_path):
    args = _args(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 1})
    with pytest.raises(
        ValueError, match=r"FSDP2 only; TrainingArguments\(fsdp=True\) with FSDP version 1 asks for FSDP1"
    ):
        HybridSPTrainer(model=tiny_causal_lm("llama", **SMALL), args=args, hybridsp={"ulysses": 1, "ring": 1})


def test_fsdp_version_1_from_accelerate_launch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match=r"accelerate's distributed_type FSDP \(FSDP_VERSION=1\) asks for FSDP1"):
        HybridSPTrainer(
            model=tiny_causal_lm("llama", **SMALL), args=_args(tmp_path), hybridsp={"ulysses": 1, "ring": 1}
        )


def test_the_launcher_request_is_read_whole(monkeypatch):
    from hybridsp.integrations.fsdp._requested import fsdp2_request

    for key, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_RESHARD_AFTER_FORWARD": "false",
        "FSDP_OFFLOAD_PARAMS": "true",
        "FSDP_ACTIVATION_CHECKPOINTING": "true",
        "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true",
        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
        "FSDP_AUTO_WRAP_POLICY": "NO_WRAP",
    }.items():
        monkeypatch.setenv(key, value)
    request = fsdp2_request(TrainingArguments(output_dir="unused", use_cpu=True, report_to=[]))
    assert request is not None
    assert (request.reshard_after_forward, request.cpu_offload) == (False, True)
    assert request.activation_checkpointing and request.activation_checkpointing_offload
    assert request.layer_classes == ("LlamaDecoderLayer",) and request.wrap_policy == "NO_WRAP"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert fsdp2_request(TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])) is None


def test_the_training_arguments_request_is_read_whole(tmp_path):
    from hybridsp.integrations.fsdp._requested import fsdp2_request

    config = {"fsdp_version": 2, "reshard_after_forward": False, "cpu_offload": True}
    config |= {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "activation_checkpointing": True}
    request = fsdp2_request(_args(tmp_path, fsdp=True, fsdp_config=config))
    assert request is not None and request.asked.startswith("TrainingArguments(fsdp=True)")
    assert (request.reshard_after_forward, request.cpu_offload, request.activation_checkpointing) == (False, True, True)
    assert request.layer_classes == ("LlamaDecoderLayer",)


def test_fsdp_with_deepspeed_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    config = {"hybridsp": {"ulysses": 1, "ring": 1}, "zero_optimization": {"stage": 1}}
    with pytest.raises(ValueError, match=r"got both DeepSpeed .* and FSDP .*: choose one"):
        HybridSPTrainer(model=tiny_causal_lm("llama", **SMALL), args=_args(tmp_path, deepspeed=config))


def test_fully_shard_model_refuses_the_tensor_axis_and_models_without_layers():
    import torch

    from hybridsp.integrations.fsdp import decoder_layers, fully_shard_model
    from hybridsp.mesh import HybridMesh, MeshShape

    groups = dict.fromkeys(["ulysses", "ring", "context", "data", "data_context", "tensor"])
    mesh = HybridMesh(MeshShape(4, 1, 2, tensor=2), 0, groups)  # no groups: the refusal comes first
    with pytest.raises(ValueError, match=r"FSDP2 does not compose with hybridsp's tensor axis \(tensor=2\)"):
        fully_shard_model(tiny_causal_lm("llama", **SMALL), mesh)
    with pytest.raises(ValueError, match="names no decoder layer class in _no_split_modules"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert len(decoder_layers(tiny_causal_lm("llama", **SMALL))) == 1


@pytest.mark.distributed
def test_fsdp2_after_a_deepspeed_trainer_in_one_process_is_refused():
    """accelerate's state is process-wide: FSDP2 after DeepSpeed in one process is one clear line."""
    from hybridsp.testing import run_distributed
    from tests.helpers.workers.trainer_fsdp import fsdp_after_deepspeed

    message = run_distributed(fsdp_after_deepspeed, 1, timeout=300)[0]
    assert "already uses DeepSpeed" in message and "run FSDP2 in a fresh process" in message, message


def test_a_size_based_wrap_policy_is_refused(tmp_path, monkeypatch):
    """The hybrid shards by decoder layer (or the root alone); a size-based policy would be silently ignored."""
    from hybridsp.integrations.fsdp._requested import fsdp2_request

    config = {"fsdp_version": 2, "auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}
    with pytest.raises(ValueError, match="auto-wrap policy 'SIZE_BASED_WRAP': use TRANSFORMER_BASED_WRAP"):
        fsdp2_request(_args(tmp_path, fsdp=True, fsdp_config=config))
    for key, value in {
        "ACCELERATE_USE_FSDP": "true",
        "FSDP_VERSION": "2",
        "FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        ValueError, match=r"accelerate's distributed_type FSDP \(FSDP_VERSION=2\) asks for the auto-wrap"
    ):
        fsdp2_request(TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))


def test_the_accelerators_mixed_precision_sets_the_fsdp2_policy():
    """bf16 / fp16 from the Trainer's flags or accelerate's launcher (the accelerator's mode) give bf16 / fp16
    compute with fp32 reduction; "no" gives none."""
    import torch

    from hybridsp.integrations.transformers._fsdp2_trainer import mixed_precision_policy

    for mode, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        policy = mixed_precision_policy(mode)
        assert (policy.param_dtype, policy.reduce_dtype) == (dtype, torch.float32)
    assert mixed_precision_policy("no") is None
