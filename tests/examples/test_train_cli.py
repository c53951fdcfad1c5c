"""examples/train.py pieces a user meets: run directories, the plot without matplotlib, preflight."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))

import preflight  # noqa: E402
import train  # noqa: E402

pytestmark = pytest.mark.integration


def test_each_config_and_mesh_gets_its_own_run_directory():
    main_job = preflight.default_save_dir("ds_configs/cp8.json", 4, 2)
    single = preflight.default_save_dir("ds_configs/cp8.json", 1, 1)
    assert main_job == Path("runs/cp8-u4r2") and single == Path("runs/cp8-u1r1")


def test_preflight_uses_the_overrides_and_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / "cp8.json"), "--ulysses", "2", "--ring", "1"])
    plan = preflight.preflight(args)
    assert (plan.hybrid.ulysses, plan.hybrid.ring, plan.world_size) == (2, 1, 2)
    assert plan.save_dir == Path("runs/cp8-u2r1")


def test_sequence_the_layout_cannot_split_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / "cp8.json"), "--seq-len", "1001"])
    with pytest.raises(preflight.RunConfigError, match="sequence length 1001"):
        preflight.preflight(args)


def test_loss_curve_is_skipped_with_one_warning_without_matplotlib(tmp_path, monkeypatch):
    metrics = train.Metrics(tmp_path / "metrics.jsonl", resume=False, enabled=True)
    metrics.log({"step": 1, "loss": 2.0, "tokens_per_s": 10.0, "step_seconds": 1.0, "warmup": True})
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert metrics.plot(tmp_path / "loss.png") is None
    assert not (tmp_path / "loss.png").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_summary_leaves_the_warm_up_step_out():
    metrics = train.Metrics(Path("unused.jsonl"), resume=False, enabled=False)
    metrics.history = [
        {"step": 1, "loss": 5.0, "tokens_per_s": 20.0, "step_seconds": 50.0, "warmup": True, "rss_bytes_max": 2**30},
        {"step": 2, "loss": 4.0, "tokens_per_s": 700.0, "step_seconds": 1.5, "warmup": False, "rss_bytes_max": 2**30},
        {"step": 3, "loss": 3.0, "tokens_per_s": 800.0, "step_seconds": 1.4, "warmup": False, "rss_bytes_max": 2**30},
    ]
    line = metrics.summary(0, None, Path("runs/x"))
    assert "800 tokens/s" in line and "5.000 -> 3.000" in line and "50.0 s of warm-up" in line


def test_summary_shows_the_mean_of_the_last_steps_beside_the_last_batch():
    metrics = train.Metrics(Path("unused.jsonl"), resume=False, enabled=False)
    losses = [6.0, 5.0, *([3.0, 1.0] * 6)]  # 14 steps; the last batch alone says 1.0
    metrics.history = [
        {"step": i + 1, "loss": loss, "tokens_per_s": 100.0, "step_seconds": 1.0, "warmup": i == 0}
        for i, loss in enumerate(losses)
    ]
    last = losses[-train.SMOOTHED_STEPS :]
    line = metrics.summary(0, None, Path("runs/x"))
    assert f"6.000 -> 1.000 (mean of the last 10 steps {sum(last) / len(last):.3f})" in line, line
    metrics.history = metrics.history[:3]  # fewer steps than the window: their mean
    assert "6.000 -> 3.000 (mean of the last 3 steps 4.667)" in metrics.summary(0, None, Path("runs/x"))


def test_layout_flag_reaches_the_mesh_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = train.parse_args(
        [
            "--deepspeed",
            str(ROOT / "ds_configs" / "cp8.json"),
            "--ulysses",
            "2",
            "--ring",
            "2",
            "--pack",
            "--layout",
            "balanced",
        ]
    )
    plan = preflight.preflight(args)
    assert plan.hybrid.layout == "balanced" and args.pack


def _previous_run(directory: Path, *names: str) -> Path:
    directory.mkdir(parents=True)
    for name in names:
        if name.endswith("/"):
            (directory / name).mkdir()
            (directory / name / "mp_rank_00_model_states.pt").write_bytes(b"")
        else:
            (directory / name).write_text("step2\n")
    return directory


def test_a_rerun_into_a_used_run_directory_needs_overwrite_or_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    run = _previous_run(tmp_path / "run", "metrics.jsonl", "latest", "step2/")
    base = ["--deepspeed", str(ROOT / "ds_configs" / "cp1.json"), "--save-dir", str(run)]
    with pytest.raises(preflight.RunConfigError) as error:
        preflight.preflight(train.parse_args(base))
    assert str(error.value) == (
        f"{run} already holds a run (metrics.jsonl, latest, step2); pass --resume to continue "
        f"it, --overwrite to write over it, or --save-dir DIR for a new one"
    )
    for extra in (["--overwrite"], ["--resume"], ["--resume-from", str(run / "step2")]):
        assert preflight.preflight(train.parse_args(base + extra)).save_dir == run
    fresh = train.parse_args(
        ["--deepspeed", str(ROOT / "ds_configs" / "cp1.json"), "--save-dir", str(tmp_path / "new")]
    )
    assert preflight.preflight(fresh).save_dir == tmp_path / "new"  # the README's first run: no directory yet
    (tmp_path / "empty").mkdir()
    assert preflight.previous_run(tmp_path / "empty") == []


def test_the_readme_command_run_twice_writes_over_the_default_run_directory(tmp_path, monkeypatch, capsys):
    """No --save-dir: the second run goes into the same default directory and says so on rank 0's console."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(tmp_path)
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / "cp1.json")])
    first = preflight.preflight(args)
    assert first.save_dir == Path("runs/cp1-u1r1") and first.notice is None  # nothing there yet
    _previous_run(tmp_path / "runs" / "cp1-u1r1", "metrics.jsonl", "latest", "step2/")
    second = preflight.preflight(args)
    assert second.save_dir == first.save_dir
    assert second.notice == (
        "runs/cp1-u1r1 holds an earlier run (metrics.jsonl, latest, step2): this run writes over it "
        "(--resume continues it instead, --save-dir DIR keeps it)"
    )
    preflight.announce(second)
    assert capsys.readouterr().out == second.notice + "\n"
    for extra in (["--resume"], ["--overwrite"]):
        assert (
            preflight.preflight(train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / "cp1.json"), *extra])).notice
            is None
        )


def test_the_hf_trainer_example_refuses_a_used_output_dir(tmp_path, monkeypatch):
    import train_hf_trainer

    monkeypatch.setenv("WORLD_SIZE", "1")
    out = _previous_run(tmp_path / "out", "checkpoint-4/")
    base = [
        "--deepspeed",
        str(ROOT / "ds_configs" / "trainer" / "cp2.json"),
        "--ulysses",
        "1",
        "--output-dir",
        str(out),
    ]
    with pytest.raises(preflight.RunConfigError, match=r"holds a run \(checkpoint-4\).*--output-dir DIR"):
        preflight.preflight(train_hf_trainer.parse_args(base))
    assert preflight.preflight(train_hf_trainer.parse_args(base + ["--resume"])).save_dir == out


def test_the_hf_trainer_example_sizes_its_data_by_replicas_not_ranks(monkeypatch):
    """U2xR1 and U1xR2 on 2 ranks take the rows of one process (DP 1); U1xR1 on 2 ranks takes twice as many (DP 2)."""
    import train_hf_trainer

    def rows(world: int, ulysses: int, ring: int) -> int:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        config = str(ROOT / "ds_configs" / "trainer" / "cp2.json")
        args = train_hf_trainer.parse_args(["--deepspeed", config, "--ulysses", str(ulysses), "--ring", str(ring)])
        return train_hf_trainer.dataset_rows(preflight.preflight(args), micro_batch=3, accumulation=2)

    assert rows(1, 1, 1) == rows(2, 2, 1) == rows(2, 1, 2) == 6
    assert rows(2, 1, 1) == rows(4, 2, 1) == 12


@pytest.mark.slow  # the message: test_a_rerun_into_a_used_run_directory_needs_overwrite_or_resume; one line, exit 2: test_launch_failures
def test_a_rerun_into_a_named_run_directory_is_one_error_line_and_exit_2(tmp_path):
    import os
    import subprocess

    run = _previous_run(tmp_path / "runs" / "mine", "metrics.jsonl")
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--deepspeed", str(ROOT / "ds_configs" / "cp1.json")]
        + ["--save-dir", "runs/mine"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "WORLD_SIZE": "1", "RANK": "0"},
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        f"train.py: error: {run.relative_to(tmp_path)} already holds a run (metrics.jsonl); "
        f"pass --resume to continue it, --overwrite to write over it, or --save-dir DIR "
        f"for a new one"
    )


def _lean_memory_args(*flags: str):
    return train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / "cp8.json"), *flags])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lean_memory_switches_every_technique_on_the_model(checkpointing):
    from tests.helpers.models.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", seed=0, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    flags = ["--lean-memory"] + (["--activation-checkpointing"] if checkpointing else [])
    train.lean_memory(_lean_memory_args(*flags), model)
    layer = model.model.layers[0]
    patched = {
        name: "forward" in vars(module)
        for name, module in [
            ("mlp", layer.mlp),
            ("norm", layer.input_layernorm),
            ("attention", layer.self_attn),
            ("layer", layer),
        ]
    }
    assert patched == {"mlp": True, "norm": True, "attention": True, "layer": checkpointing}


def test_without_the_flag_nothing_changes_and_a_model_it_cannot_take_is_one_error():
    from tests.helpers.models.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", seed=0, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    train.lean_memory(_lean_memory_args(), model)
    assert not any("forward" in vars(module) for module in model.modules())
    neox = tiny_causal_lm(
        "gpt_neox",
        seed=0,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=64,
    )
    with pytest.raises(preflight.RunConfigError, match="--lean-memory: apply_tiled_mlp: .*drop --lean-memory"):
        train.lean_memory(_lean_memory_args("--lean-memory"), neox)


def test_offload_dir_goes_to_the_offload_and_its_mistakes_are_one_error(tmp_path):
    from tests.helpers.models.tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", seed=0, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    model.gradient_checkpointing_enable()
    both = ["--activation-checkpointing", "--offload-activations"]
    offload = train.activation_offload(_lean_memory_args(*both, "--offload-dir", str(tmp_path)), model)
    assert offload.disk is not None and offload.disk.directory == str(tmp_path)
    offload.remove()
    assert train.activation_offload(_lean_memory_args(*both), model).disk is None
    with pytest.raises(preflight.RunConfigError, match="--offload-dir needs --offload-activations"):
        train.activation_offload(_lean_memory_args("--offload-dir", str(tmp_path)), model)
    with pytest.raises(preflight.RunConfigError, match=r"--offload-dir: spill_dir .*missing.* is not a directory"):
        train.activation_offload(_lean_memory_args(*both, "--offload-dir", str(tmp_path / "missing")), model)
