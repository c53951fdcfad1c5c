"""The memory helpers under DeepSpeed ZeRO-3 with sequence parallelism (2 gloo ranks, U=2, fp32).

A tiny Llama (untied and tied embeddings) trains 2 SGD steps from the same seed on the same batch
through ``hybridsp.integrations.deepspeed.initialize``:

- the reference: logits + ``sharded_cross_entropy`` (the path tests/integrations/deepspeed/test_engine.py checks
  against DeepSpeed without sequence parallelism);
- ``causal_lm_loss`` (fused linear + cross-entropy through the lm_head call);
- the same plus ``apply_tiled_mlp``; and plus HF activation checkpointing; and plus split checkpointing,
  with lean norms and with HF's (the q/k/v projections keep the norm's input instead of the ZeRO-3 alias
  of its output and rebuild it in their backward, the norm's partitioned weight gathered there);
- ``fused_cross_entropy`` called directly on the decoder's output and the *partitioned*
  ``lm_head`` weight (``model.lm_head.weight``, NOT_AVAILABLE at the call; untied and tied): it
  gathers the weight once for the call and its gradient reaches ZeRO-3's reduction once
  (``hybridsp.integrations.deepspeed._zero``), so the training steps equal the reference's; under no_grad it
  gives the logits path's loss.

Loss, every reduced gradient (as ZeRO-3 holds it) at each step and the final parameters must
equal the reference's (relative 1e-5). One launch for every case.
"""

import contextlib
from unittest import mock

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.deepspeed_engines import forbid_jit_builds, full_grads, full_params
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.integration]  # DeepSpeed ZeRO-3 engines

WORLD, SEQ, VOCAB, STEPS, LR, HIDDEN = 2, 48, 96, 2, 0.5, 32
TOLERANCE = 1e-5


def _model(tied: bool):
    from tests.helpers.models.tiny import tiny_causal_lm

    return tiny_causal_lm(
        "llama",
        seed=0,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )


def _config() -> dict:
    from hybridsp.integrations.deepspeed import load_config

    config = load_config(ROOT / "ds_configs" / "cp2.json")
    config.pop("optimizer")
    zero = {**config["zero_optimization"], "stage": 3, "stage3_param_persistence_threshold": 0}
    return {
        **config,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }


def _batch() -> dict:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[1, SEQ - 10 :] = -100  # some ignored targets
    return {"input_ids": ids, "labels": labels}


def _train(
    tied: bool, fused: bool, tiled: bool, checkpointing: bool, direct: bool = False, split: bool = False
) -> dict:
    from hybridsp import apply_lean_norms, apply_split_checkpointing, shard_batch
    from hybridsp.integrations import deepspeed as hds
    from hybridsp.memory._tiled_mlp import apply_tiled_mlp

    model = _model(tied)
    if checkpointing:
        model.gradient_checkpointing_enable()
    if tiled:
        apply_tiled_mlp(model, tile_tokens=5)
    if split == "lean":  # the projections rebuild the lean norm's output from the ZeRO-3 input alias they keep
        apply_lean_norms(model, tile_tokens=5)
    if split:
        apply_split_checkpointing(model)
    engine, _, mesh, _ = hds.initialize(model, _config(), optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    engine.train()
    local = shard_batch(_batch(), mesh)
    trace = {"losses": [], "grads": []}
    with _counted_rebuilds(trace):
        for _ in range(STEPS):
            loss = _loss(engine, local, mesh, fused, direct, trace)
            engine.backward(loss)
            trace["grads"].append(full_grads(engine))
            engine.step()
            trace["losses"].append(loss.item())
    trace["params"] = full_params(engine)
    if direct:
        trace.update(_scoring(engine, local, mesh))
    return trace


def _loss(engine, local: dict, mesh, fused: bool, direct: bool, trace: dict) -> torch.Tensor:
    from hybridsp import fused_cross_entropy, sharded_cross_entropy
    from hybridsp.integrations.transformers import causal_lm_loss

    if direct:  # the decoder alone, then the loss on the partitioned lm_head weight, outside any module
        hidden = engine.module.model(
            input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
        ).last_hidden_state
        trace.setdefault("status", engine.module.lm_head.weight.ds_status.name)
        return fused_cross_entropy(hidden, engine.module.lm_head.weight, local["shift_labels"], mesh, chunk_size=7)
    if fused:
        return causal_lm_loss(engine, local, mesh, chunk_size=7)
    logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    return sharded_cross_entropy(logits, local["shift_labels"], mesh)


def _scoring(engine, local: dict, mesh) -> dict:
    """Under no_grad: fused_cross_entropy gathers the weight once (GatheredParameters), the logits path's value."""
    from hybridsp import fused_cross_entropy, sharded_cross_entropy

    with torch.no_grad():
        hidden = engine.module.model(
            input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
        ).last_hidden_state
        scored = fused_cross_entropy(hidden, engine.module.lm_head.weight, local["shift_labels"], mesh, chunk_size=7)
        logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        expected = sharded_cross_entropy(logits, local["shift_labels"], mesh)
    return {"scored": scored.item(), "expected": expected.item()}


@contextlib.contextmanager
def _counted_rebuilds(trace: dict):
    """trace["rebuilds"]: how many times a norm's output was rebuilt (hybridsp.memory._norm_rebuild)."""
    from hybridsp.memory._norm_rebuild import _SharedRebuild

    with mock.patch.object(_SharedRebuild, "_rebuild", autospec=True, side_effect=_SharedRebuild._rebuild) as spy:
        yield
    trace["rebuilds"] = spy.call_count


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _everything(rank, world, directory):
    torch.set_num_threads(1)
    forbid_jit_builds(directory)
    out = {}
    for tied in (False, True):
        reference = _train(tied, fused=False, tiled=False, checkpointing=False)
        variants = {
            "fused": (True, False, False),
            "fused+tiled": (True, True, False),
            "direct fused_cross_entropy": (True, False, False, True),
        }
        if tied:
            variants["fused+tiled+ckpt"] = (True, True, True)
            variants["fused+tiled+ckpt split lean norms"] = (True, True, True, False, "lean")
            variants["fused+tiled+ckpt split HF norms"] = (True, True, True, False, "hf")
        for name, flags in variants.items():
            run = _train(tied, *flags)
            out[f"tied={tied} {name}"] = {
                "loss": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], reference["losses"])),
                "grad": max(_rel(a, b) for a, b in zip(run["grads"], reference["grads"])),
                "params": _rel(run["params"], reference["params"]),
                "grad_norm": reference["grads"][0].norm().item(),
                "rebuilds": run["rebuilds"],
            }
            if name.startswith("direct"):
                out[f"tied={tied} scoring"] = {key: run[key] for key in ("status", "scored", "expected")}
    return out


def test_fused_loss_and_tiled_mlp_under_zero3_equal_the_logits_path(tmp_path):
    errors = run_distributed(_everything, WORLD, str(tmp_path), timeout=300)[0]
    for tied in (False, True):
        scoring = errors.pop(f"tied={tied} scoring")
        assert scoring["status"] == "NOT_AVAILABLE", scoring  # the direct call met a partitioned weight
        assert abs(scoring["scored"] - scoring["expected"]) <= 1e-5 * scoring["expected"], scoring
    for name, row in errors.items():
        assert row["grad_norm"] > 0, (name, row)
        assert max(row["loss"], row["grad"], row["params"]) < TOLERANCE, (name, row)
        assert row["rebuilds"] == (STEPS * 2 if "split" in name else 0), (name, row)  # once per layer and step
    assert len(errors) == 9
