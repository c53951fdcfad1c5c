"""The planner's tensor axis: per-rank bytes by hand, and its view of Llama-3-70B at 1M tokens."""

import pytest

from hybridsp.planner._specs import MODELS, ModelSpec, preset_cluster
from hybridsp.planner._tensor import (
    inference_option,
    inference_options,
    param_bytes_per_rank,
    recommend_inference,
    sequence_parallel_saving,
)

TINY = ModelSpec(
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    vocab_size=100,
    name="tiny",
)


def test_terms_by_hand():
    # projections per layer: q, o 128 x 128; k, v 128 x 64; MLP 3 x 128 x 256 -> 139,264; x 2 layers
    split, whole = 2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256), 2 * 2 * 128 + 128 + 2 * 100 * 128
    assert param_bytes_per_rank(TINY, 2, 2) == (split // 2 + whole) * 2
    cluster = preset_cluster("h100", 1, 8)
    option = inference_option(TINY, cluster, 1024, tensor=2, ulysses=2, ring=2, dtype_bytes=2)
    assert option.kv_cache == 2 * 2 * (4 // 2) * 16 * (1024 // 4) * 2  # 2 L Hkv/T D S/C e
    assert option.activations == 256 * 2 * (3 * 128 + 3 * 256 // 2 + 2 * (4 + 2 * 2) * 16)
    assert option.tp_bytes == 2 * 2 * 2 * (1 / 2) * 256 * 128 * 2  # L x 2 all-reduces x 2(T-1)/T x S/C h e
    assert sequence_parallel_saving(TINY, 1024, 4, 2) == (2 * 2 + 1) * 1024 * 128 * 2 * 3 // 4


def test_llama3_70b_at_1m_tokens_on_2x8_h100_needs_t_greater_than_1():
    model, cluster = MODELS["llama3-70b"], preset_cluster("h100", 2, 8)
    without = inference_options(model, cluster, 1 << 20, tensor=1)
    assert not any(o.fits for o in without)  # 131 GiB of bf16 weights per rank
    with pytest.raises(ValueError, match="does not fit"):
        recommend_inference(model, cluster, 1 << 20)  # the prefill's hidden states on every tensor rank: 77 GiB
    best = recommend_inference(model, cluster, 1 << 20, sequence_parallel=True)
    assert best.tensor > 1 and best.fits and best.tensor * best.ulysses * best.ring == 16


def test_small_model_keeps_t_1():
    assert recommend_inference(MODELS["llama3-8b"], preset_cluster("h100", 2, 8), 1 << 20).tensor == 1


def test_plan_cli_ranks_tensor_meshes_for_a_long_prefill():
    import json
    import subprocess
    import sys

    run = lambda *extra: subprocess.run(  # noqa: E731
        [
            sys.executable,
            "-m",
            "hybridsp",
            "plan",
            "--model",
            "llama3-70b",
            "--seq-len",
            "1000000",
            "--nodes",
            "2",
            "--tensor-inference",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    with_sp = run("--tensor-sp")
    options = json.loads(with_sp.stdout)["tensor_inference"]
    assert with_sp.returncode == 0 and options[0]["fits"] and options[0]["tensor"] > 1
    assert all(not o["fits"] for o in options if o["tensor"] == 1)  # 70B weights alone do not fit one H100
