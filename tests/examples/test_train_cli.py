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


def test_layout_flag_reaches_the_mesh_config(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = train.parse_args(["--deepspeed", str(ROOT / "ds_configs" / "cp8.json"), "--ulysses", "2", "--ring", "2",
                             "--pack", "--layout", "balanced"])
    plan = preflight.preflight(args)
    assert plan.hybrid.layout == "balanced" and args.pack
