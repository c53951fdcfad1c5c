"""The examples' user errors: every problem in one line with exit code 2, no
traceback; the data problems too; the config's learning rate is used unless --lr is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))

import preflight  # noqa: E402
import train  # noqa: E402
import train_hf_trainer  # noqa: E402

pytestmark = pytest.mark.integration

CP4 = str(ROOT / "ds_configs" / "cp4.json")


def _direct(tmp_path: Path, script: str, *args: str, world: int = 4) -> subprocess.CompletedProcess:
    """Rank 0 of ``world`` as a launcher would start it (failing before it needs its peers)."""
    env = {**os.environ, "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )  # a hang catcher


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_head_counts_name_the_failing_quantity_and_a_value_that_works():
    """Before: ``--heads 6 must be a multiple of --kv-heads 2 and divide --hidden-size 256`` (6 is a multiple of 2)."""
    args = train.parse_args(["--heads", "6", "--kv-heads", "2", "--hidden-size", "256"])
    assert preflight.argument_problems(args) == [
        "the hidden size (--hidden-size 256) must be a multiple of the query heads (--heads 6) to give each head "
        "42.6667 dimensions; pass --heads 4 or a --hidden-size that 6 divides (e.g. 258)"
    ]
    args = train.parse_args(["--heads", "8", "--kv-heads", "3", "--hidden-size", "256"])
    assert preflight.argument_problems(args) == [
        "the query heads (--heads 8) must be a multiple of the key/value heads (--kv-heads 3); pass --kv-heads 2 "
        "(or a divisor of 8)"
    ]


def test_every_problem_is_reported_at_once(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    args = train.parse_args(
        ["--deepspeed", CP4, "--heads", "3", "--kv-heads", "1", "--hidden-size", "96", "--seq-len", "0", "--lr", "-1"]
    )
    with pytest.raises(preflight.RunConfigError) as error:
        preflight.preflight(args)
    message = str(error.value)
    assert message.startswith("4 problems: (1) --seq-len must be at least 1; got 0"), message
    for part in (
        "--lr must be a positive number; got -1.0",
        "do not divide the world size 6",
        "3 query heads are not divisible by ulysses=2",
    ):
        assert part in message, message


def test_a_missing_config_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(preflight.RunConfigError, match=r"nope\.json does not exist \(pass --deepspeed PATH"):
        preflight.preflight(train.parse_args(["--deepspeed", str(tmp_path / "nope.json")]))


def test_sequence_length_message_names_the_option(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(preflight.RunConfigError, match=r"^--seq-len 1001: sequence length 1001"):
        preflight.preflight(train.parse_args(["--deepspeed", CP4, "--seq-len", "1001"]))


def test_hf_trainer_example_reports_problems_in_one_line_exit_2(tmp_path):
    """train.py's preflight is the same function (tests above; test_launch_failures runs it as a process)."""
    missing = tmp_path / "none.txt"
    line = _one_error_line(
        _direct(tmp_path, "train_hf_trainer.py", "--deepspeed", CP4, "--seq-len", "-5", "--data", str(missing))
    )
    assert line.startswith("train_hf_trainer.py: error: 2 problems:"), line
    assert "--seq-len must be at least 1; got -5" in line and f"--data {missing} does not exist" in line


def test_hf_trainer_example_refuses_a_tensor_config_in_one_line(tmp_path):
    """Before: HybridSPTrainer trained the unsplit weights on both tensor ranks; now exit 2, one line."""
    tp2 = str(ROOT / "ds_configs" / "tensor" / "tp2_cp2.json")
    for extra in ((), ("--tensor", "2")):
        line = _one_error_line(_direct(tmp_path, "train_hf_trainer.py", "--deepspeed", tp2, *extra))
        assert line.startswith("train_hf_trainer.py: error: tensor=2"), line
        assert "examples/train.py --tensor 2" in line and "docs/tensor-parallel.md" in line, line


def test_too_short_or_broken_data_is_a_config_error(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("only a few bytes")
    args = train.parse_args(["--data", str(short), "--seq-len", "64"])
    with pytest.raises(preflight.RunConfigError, match=r"has 16 tokens.*longer --data file or a smaller --seq-len"):
        train.load_windows(args, 64)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(preflight.RunConfigError, match=r"broken.jsonl line 2 is not a JSON object with a 'text'"):
        train.load_windows(train.parse_args(["--data", str(broken)]), 64)


def test_the_configs_learning_rate_is_used_unless_lr_is_given():
    cp8 = str(ROOT / "ds_configs" / "cp8.json")
    config_lr = 0.0002  # what every ds_configs/*.json file says
    assert train._config_with_lr(train.parse_args(["--deepspeed", cp8]))["optimizer"]["params"]["lr"] == config_lr
    given = train._config_with_lr(train.parse_args(["--deepspeed", cp8, "--lr", "5e-4"]))
    assert given["optimizer"]["params"]["lr"] == 5e-4
    hf_args = train_hf_trainer.parse_args(["--deepspeed", cp8])
    assert train_hf_trainer.learning_rate(hf_args, train_hf_trainer.load_ds_config(hf_args)) == config_lr
    hf_args = train_hf_trainer.parse_args(["--deepspeed", cp8, "--lr", "3e-3"])
    assert train_hf_trainer.learning_rate(hf_args, train_hf_trainer.load_ds_config(hf_args)) == 3e-3


def test_train_py_needs_numeric_batch_sizes_and_an_optimizer(tmp_path, monkeypatch):
    import json

    config = json.loads(Path(CP4).read_text())
    config["gradient_accumulation_steps"] = "auto"
    del config["optimizer"]
    path = tmp_path / "auto.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(preflight.RunConfigError) as error:
        preflight.preflight(train.parse_args(["--deepspeed", str(path)]))
    assert "gradient_accumulation_steps must be a positive integer for train.py; got 'auto'" in str(error.value)
    assert "has no 'optimizer' section" in str(error.value)
    preflight.preflight(train_hf_trainer.parse_args(["--deepspeed", str(path)]))  # the Trainer fills both


def _tiny_foreign_model(tmp_path: Path, kind: str) -> Path:
    """A tiny Mamba (no attention at all) or T5 (encoder-decoder) config saved locally: models the switch refuses."""
    from transformers import MambaConfig, T5Config

    if kind == "mamba":
        config = MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4)
    else:
        config = T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16)
    config.save_pretrained(tmp_path / kind)
    return tmp_path / kind


REASONS = {
    "mamba": "MambaForCausalLM mixes tokens outside attention in modules hybridsp does not implement: MambaMixer in "
    "layers 0 (its own parameter 'A_log', the mark of a state-space, decay or dynamic-mask mixer). Run per shard they "
    "would restart at every shard boundary (silently wrong), so nothing was switched. Train this model without "
    "sequence parallelism, or implement a MixerAdapter for them and pass apply(model, mesh, "
    "mixers=(*default_mixers(), YourAdapter()))",
    "t5": "Unrecognized configuration class <class 'transformers.models.t5.configuration_t5.T5Config'> for this kind "
    "of AutoModel: AutoModelForCausalLM.",
}


@pytest.mark.parametrize("kind", ["mamba", "t5"])
def test_a_model_the_switch_cannot_take_is_one_preflight_sentence(tmp_path, monkeypatch, kind):
    path = _tiny_foreign_model(tmp_path, kind)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(preflight.RunConfigError) as error:
        preflight.preflight(train.parse_args(["--deepspeed", CP4, "--model-path", str(path)]))
    assert str(error.value) == (
        f"--model-path {path} is a {kind!r} model hybridsp's attention switch cannot take: "
        f"{REASONS[kind]} (docs/model-support.md)"
    )


def test_a_mamba_model_path_is_one_error_line_on_rank_0_and_silence_elsewhere(tmp_path):
    path = _tiny_foreign_model(tmp_path, "mamba")
    line = _one_error_line(_direct(tmp_path, "train.py", "--deepspeed", CP4, "--model-path", str(path)))
    assert line.startswith(f"train.py: error: --model-path {path} is a 'mamba' model hybridsp's"), line
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}
    other = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--deepspeed", CP4, "--model-path", str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (other.returncode, other.stderr.strip(), other.stdout.strip()) == (2, "", "")
