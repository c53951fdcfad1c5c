"""HybridSPTrainer and the TRL trainers refuse FSDP in words (before any collective) instead of training as DDP."""

from __future__ import annotations

import pytest
from transformers import TrainingArguments

from hybridsp.integrations.transformers import HybridSPTrainer
from tests.helpers.models.tiny import tiny_causal_lm

pytestmark = [pytest.mark.integration]

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)


def _args(tmp_path, **fields) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **fields)


def test_fsdp2_in_the_training_arguments_is_refused(tmp_path):
    args = _args(tmp_path, fsdp=True, fsdp_config={"fsdp_version": 2})
    with pytest.raises(ValueError, match=r"does not shard with FSDP yet \(TrainingArguments\(fsdp=.*FSDP version 2\)"):
        HybridSPTrainer(model=tiny_causal_lm("llama", **SMALL), args=args, hybridsp={"ulysses": 1, "ring": 1})


def test_fsdp_from_accelerate_launch_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match=r"accelerate's distributed_type FSDP \(FSDP_VERSION=2\)"):
        HybridSPTrainer(
            model=tiny_causal_lm("llama", **SMALL), args=_args(tmp_path), hybridsp={"ulysses": 1, "ring": 1}
        )


@pytest.mark.slow  # the same check as above through TRL (its import is the cost)
def test_the_sft_trainer_refuses_it_too(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hybridsp.integrations.trl import HybridSFTTrainer
    from tests.helpers.workers.trl_sft import tokenizer

    args = trl.SFTConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True, fsdp_config={"fsdp_version": 2}
    )
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4]]})
    with pytest.raises(ValueError, match="does not shard with FSDP yet"):
        HybridSFTTrainer(
            model=tiny_causal_lm("llama", **SMALL),
            args=args,
            train_dataset=data,
            processing_class=tokenizer(),
            hybridsp={"ring": 1},
        )


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
