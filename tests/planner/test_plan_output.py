"""``python -m hybridsp plan`` output a user reads: the no-fit hint names the techniques that are off and
would help, the 2% tie rule is explained, --forward-only and --tensor-inference point to each other,
--doc-lengths changes the step time, 128k / 1M parse, help texts name no internal classes."""

from __future__ import annotations

import argparse
import json

import pytest

from hybridsp.__main__ import main
from hybridsp.planner._cli import add_arguments
from hybridsp.planner._options import _tokens
from hybridsp.planner._packing import attention_work_fraction


def _plan(capsys, *args: str) -> tuple[int, str]:
    status = main(["plan", *args])
    return status, capsys.readouterr().out


def test_token_counts_take_k_and_m_as_powers_of_1024():
    assert [_tokens(t) for t in ("4096", "128k", "128K", "1M", "1.5M", "1m")] == [
        4096,
        131072,
        131072,
        1048576,
        1572864,
        1048576,
    ]
    for bad in ("0", "-1k", "1.5", "0.0001k", "x", "k"):
        with pytest.raises(argparse.ArgumentTypeError, match="128k"):
            _tokens(bad)


def test_no_fit_hint_names_only_techniques_that_are_off_and_helpful(capsys):
    status, out = _plan(
        capsys,
        "--model",
        "llama3-8b",
        "--seq-len",
        "128k",
        "--zero",
        "1",
        "--activation-checkpointing",
        "off",
        "--fused-loss",
    )
    assert status == 1
    hint = out[out.index("No plan fits") :]
    assert "--activation-checkpointing: fits," in hint and "--tiled-mlp: no fit," in hint
    assert "--offload-activations --activation-checkpointing: fits," in hint
    assert "--fused-loss" not in hint  # already on
    status, out = _plan(capsys, "--model", "llama3-70b", "--seq-len", "1M", "--activation-checkpointing", "on")
    hint = out[out.index("No plan fits") :]
    assert "--activation-checkpointing:" not in hint and "--zero 3" not in hint  # on / searched already
    assert "--fused-loss: no fit," in hint and "All of them together:" in hint and "--longest-context" in hint


def test_forward_only_hint_has_no_training_techniques(capsys):
    status, out = _plan(capsys, "--model", "llama3-70b", "--seq-len", "1M", "--forward-only", "--nodes", "1")
    hint = out[out.index("No plan fits") :]
    assert status == 1 and "checkpointing" not in hint and "offload-optimizer" not in hint
    assert "--tensor-inference splits the weights" in hint


def test_the_tie_rule_is_explained_when_a_slower_plan_is_picked(capsys):
    _, out = _plan(capsys, "--model", "llama3-8b", "--seq-len", "32k", "--forward-only")
    assert (
        "picked over the fastest plan (DP=8 x U=1 x R=1, ZeRO-0, ckpt off), 1.5% slower: plans within 2% of the "
        "fastest count as tied" in out
    )
    assert "--tensor-inference plans T x Ulysses x ring meshes" in out


def test_tensor_inference_output_and_help_point_to_forward_only(capsys):
    _, out = _plan(capsys, "--model", "llama3-8b", "--seq-len", "32k", "--tensor-inference")
    assert "Note: --forward-only plans a training-style mesh" in out
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = parser.format_help()
    assert "see --tensor-inference" in text and "--forward-only instead plans" in " ".join(text.split())


def test_help_names_no_internal_classes():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "ModelSpec" not in text and "query (attention) heads" in text and "1M = 1048576" in text


def test_packed_documents_shorten_the_step(capsys):
    base = ["--model", "llama3-8b", "--seq-len", "128k", "--json"]
    main(["plan", *base])
    whole = json.loads(capsys.readouterr().out)
    main(["plan", *base, "--doc-lengths", "8192,4096"])
    packed = json.loads(capsys.readouterr().out)
    work = attention_work_fraction([8192, 4096], 131072)
    assert packed["packing"]["attention_work"] == pytest.approx(work) and 0.05 < work < 0.06
    assert packed["recommended"]["step_s"] < 0.5 * whole["recommended"]["step_s"]
    assert attention_work_fraction([10], 10) == 1.0 and attention_work_fraction([5], 10, causal=False) == 0.5
