"""Activation-checkpoint offload and the ZeRO-3 offload config, on 4 gloo ranks (U2 x R2, fp32, CPU).

One launch runs, from the same seed on the same two global batches (B=2, S=64, random tokens):

- a tiny Llama (3 layers, 4 query / 2 K/V heads) through ``hybridsp.integrations.deepspeed.initialize``
  on ZeRO-3 (``ds_configs/cp4.json``) without checkpointing, with HF activation checkpointing
  (non-reentrant), and with checkpointing + :func:`hybridsp.offload_activations`: the loss and
  every parameter's reduced gradient of two steps; offload must equal plain checkpointing
  (to 1e-6; the copies are exact) and both the run without checkpointing (1e-5); and with
  :func:`hybridsp.apply_split_checkpointing` as well (equal to plain checkpointing, both halves'
  inputs offloaded).
- ``examples/train.py`` with ``--deepspeed ds_configs/cp8_offload.json --activation-checkpointing
  --offload-activations`` against ``ds_configs/cp8.json`` with checkpointing only (2 steps, S=256), and
  ``ds_configs/cp8.json --offload-activations --lean-memory`` against it too.
- ``ds_configs/cp8_offload.json`` (optimizer offloaded to CPU; the degrees overridden to U2 x R2
  for 4 ranks), the same with ``offload_param`` on CPU as well, and the same config with both
  offload sections removed: losses, gradients and the final parameters of two AdamW steps agree
  within 1e-5, and nothing was JIT-compiled (DeepSpeed's CPU Adam would build for ~100 s).
"""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybridsp.testing import run_distributed
from tests.helpers.deepspeed_engines import full_grads, full_params
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.integration]  # DeepSpeed ZeRO-3 engines and examples/train.py

WORLD, BATCH, SEQ, VOCAB, LAYERS, STEPS, LR = 4, 2, 64, 128, 3, 2, 1e-3
TOLERANCE = 1e-5


def _model(checkpointing: bool, split: bool = False):
    from tests.helpers.models.tiny import tiny_causal_lm

    model = tiny_causal_lm(
        "llama",
        seed=0,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if split:
        from hybridsp import apply_split_checkpointing

        apply_split_checkpointing(model)
    return model


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _world_mean(value: torch.Tensor) -> float:
    total = value.detach().double().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _train(model, config: dict, offload: bool = False, spill_dir: str | None = None) -> dict:
    """Two steps through ``initialize`` (U2 x R2); per step the loss and full gradient, then the params
    (``spill_dir``: the offload's disk tier)."""
    from hybridsp import offload_activations, shard_batch, sharded_cross_entropy
    from hybridsp.integrations import deepspeed as hds

    engine, _, mesh, undo = hds.initialize(model, config, ulysses=2, ring=2)
    hooks = offload_activations(engine.module, enabled=offload, spill_dir=spill_dir)
    trace = {"loss": [], "grad": [], "stats": []}
    for tokens in _batches():
        local = shard_batch({"input_ids": tokens, "labels": tokens}, mesh)
        with hooks:
            logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
            loss = sharded_cross_entropy(logits, local["shift_labels"], mesh)
        engine.backward(loss)
        trace["grad"].append(full_grads(engine))
        trace["loss"].append(_world_mean(loss))
        trace["stats"].append(dict(vars(hooks.stats)))
        engine.step()
    trace["params"] = full_params(engine)
    param = engine.zero_offload_param()
    trace["engine"] = {
        "optimizer_offload": engine.zero_cpu_offload(),
        "basic_optimizer": type(engine.basic_optimizer).__name__,
        "param_offload": param is not None and param.device == "cpu",
        "stage3_offloads": bool(getattr(engine.optimizer, "offload_optimizer", False)),
    }
    hooks.remove()
    undo()
    return trace


def _rel(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return ((actual - expected).norm() / expected.norm()).item()


def _errors(run: dict, ref: dict) -> dict:
    return {
        "loss": max(_rel(a, b) for a, b in zip(run["loss"], ref["loss"])),
        "grad": max(_rel(a, b) for a, b in zip(run["grad"], ref["grad"])),
        "params": _rel(run["params"], ref["params"]),
    }


def _offload_config(optimizer: bool, params: bool) -> dict:
    from hybridsp.integrations.deepspeed import load_config

    config = load_config(ROOT / "ds_configs" / "cp8_offload.json")
    zero = config["zero_optimization"]
    if not optimizer:
        zero.pop("offload_optimizer")
    if params:
        zero["offload_param"] = {**zero["offload_param"], "device": "cpu"}
    else:
        zero.pop("offload_param")
    config["optimizer"]["params"]["lr"] = LR
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    config["steps_per_print"] = 10**6
    return config


EXAMPLE_RUNS = {  # examples/train.py, 2 steps at S=256 on U2 x R2
    "plain": ["--deepspeed", str(ROOT / "ds_configs" / "cp8.json"), "--activation-checkpointing"],
    "offload": [
        "--deepspeed",
        str(ROOT / "ds_configs" / "cp8_offload.json"),
        "--activation-checkpointing",
        "--offload-activations",
    ],
    "lean": [  # every memory technique the flags reach
        "--deepspeed",
        str(ROOT / "ds_configs" / "cp8.json"),
        "--activation-checkpointing",
        "--offload-activations",
        "--lean-memory",
    ],
}


def _example(directory: str, name: str, flags: list[str]) -> list[float]:
    """examples/train.py's main on this launch's ranks; rank 0's logged losses."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import train

    out = Path(directory, f"example-{name}")
    train.main(
        flags
        + ["--ulysses", "2", "--ring", "2", "--max-steps", "2", "--seq-len", "256", "--no-plot", "--save-dir", str(out)]
    )
    dist.barrier()
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _everything(rank, world, directory):
    torch.set_num_threads(1)
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions = os.path.join(directory, f"ext{rank}")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    cp4 = json.loads((ROOT / "ds_configs" / "cp4.json").read_text())
    cp4["optimizer"]["params"]["lr"] = LR
    cp4["steps_per_print"] = 10**6
    plain = _train(_model(False), copy.deepcopy(cp4))
    ckpt = _train(_model(True), copy.deepcopy(cp4))
    offloaded = _train(_model(True), copy.deepcopy(cp4), offload=True)
    spill = os.path.join(directory, f"spill{rank}")
    os.makedirs(spill)
    split = _train(_model(True, split=True), copy.deepcopy(cp4), offload=True, spill_dir=spill)
    no_offload = _train(_model(False), _offload_config(False, False))
    optimizer_offload = _train(_model(False), _offload_config(True, False))
    both_offload = _train(_model(False), _offload_config(True, True))
    flags = {name: flags + (["--offload-dir", spill] if name == "lean" else []) for name, flags in EXAMPLE_RUNS.items()}
    example = {name: _example(directory, name, flags[name]) for name in EXAMPLE_RUNS}
    return {
        "ckpt_vs_plain": _errors(ckpt, plain),
        "offload_vs_ckpt": _errors(offloaded, ckpt),
        "offload_vs_plain": _errors(offloaded, plain),
        "split_vs_ckpt": _errors(split, ckpt),
        "stats": offloaded["stats"],
        "split_stats": split["stats"],
        "spill_left": os.listdir(spill),
        "ckpt_stats": ckpt["stats"],
        "optimizer_offload": _errors(optimizer_offload, no_offload),
        "both_offload": _errors(both_offload, no_offload),
        "jit_built": os.path.exists(extensions),
        "example": example,
        "engines": {
            "none": no_offload["engine"],
            "optimizer": optimizer_offload["engine"],
            "both": both_offload["engine"],
        },
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_everything, WORLD, str(tmp_path_factory.mktemp("offload")), timeout=600)


def test_offloaded_checkpointing_equals_plain_checkpointing(runs):
    for rank in runs:
        assert max(rank["offload_vs_ckpt"].values()) < 1e-6, rank["offload_vs_ckpt"]
        assert max(rank["ckpt_vs_plain"].values()) < TOLERANCE, rank["ckpt_vs_plain"]
        assert max(rank["offload_vs_plain"].values()) < TOLERANCE, rank["offload_vs_plain"]


def test_every_layer_input_but_the_last_went_to_host(runs):
    local_tokens = BATCH * SEQ // WORLD
    for rank in runs:
        for stats in rank["stats"]:
            assert stats["offloaded_tensors"] == LAYERS - 1 and stats["kept_tensors"] == 1, stats
            assert stats["restored_tensors"] == LAYERS - 1, stats
            assert stats["offloaded_bytes"] == (LAYERS - 1) * local_tokens * 64 * 4, stats  # [B, S/C, h] fp32
        assert all(s["offloaded_tensors"] == 0 for s in rank["ckpt_stats"])  # the switch off does nothing


def test_split_checkpointing_offloads_both_halves_inputs_under_zero3(runs):
    """apply_split_checkpointing + offload to disk (``spill_dir``) on the ZeRO-3 engine (whose module
    pre-hooks hand the MLP half's norm a detached alias of h1): equal to layer-level checkpointing, and x
    and h1 of every layer but the newest input went to disk, leaving no file behind."""
    local_tokens = BATCH * SEQ // WORLD
    for rank in runs:
        assert max(rank["split_vs_ckpt"].values()) < 1e-6, rank["split_vs_ckpt"]
        for stats in rank["split_stats"]:
            assert stats["offloaded_tensors"] == 2 * LAYERS - 1 and stats["kept_tensors"] == 1, stats
            assert stats["restored_tensors"] == 2 * LAYERS - 1, stats
            assert stats["offloaded_bytes"] == (2 * LAYERS - 1) * local_tokens * 64 * 4, stats
            assert stats["spilled_bytes"] == stats["offloaded_bytes"], stats
        assert rank["spill_left"] == []


def test_example_trains_with_the_offload_config_and_flag(runs):
    """examples/train.py --deepspeed ds_configs/cp8_offload.json --offload-activations, and cp8.json with
    --offload-activations --offload-dir DIR --lean-memory (tiled MLP, lean norms, lean RoPE, split
    checkpointing, the inputs on disk), equal the cp8.json run."""
    example = runs[0]["example"]
    assert [len(losses) for losses in example.values()] == [2, 2, 2], example
    for plain, offloaded, lean in zip(example["plain"], example["offload"], example["lean"]):
        assert abs(plain - offloaded) <= TOLERANCE * abs(plain), example
        assert abs(plain - lean) <= TOLERANCE * abs(plain), example


def test_offload_config_matches_the_same_run_without_offload(runs):
    for rank in runs:
        assert max(rank["optimizer_offload"].values()) < TOLERANCE, rank["optimizer_offload"]
        assert max(rank["both_offload"].values()) < TOLERANCE, rank["both_offload"]
        assert not rank["jit_built"]
        engines = rank["engines"]
        assert engines["none"]["optimizer_offload"] is False and engines["none"]["param_offload"] is False
        assert engines["optimizer"]["optimizer_offload"] and engines["optimizer"]["stage3_offloads"], engines
        assert engines["optimizer"]["param_offload"] is False, engines
        assert engines["both"]["optimizer_offload"] and engines["both"]["param_offload"], engines
        assert {e["basic_optimizer"] for e in engines.values()} == {"AdamW"}, engines  # torch's, not CPU Adam
