"""examples/train.py --tensor: preflight takes the degree (also with gradient clipping), and refuses what
tensor parallelism cannot run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "examples"))

import preflight  # noqa: E402
import train  # noqa: E402

pytestmark = pytest.mark.integration


def _plan(monkeypatch, world, *argv):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return preflight.preflight(train.parse_args(list(argv)))


def test_tensor_flag_overrides_the_config_and_names_the_run(monkeypatch):
    plan = _plan(monkeypatch, 8, "--deepspeed", str(ROOT / "ds_configs" / "tensor" / "tp2_cp2.json"), "--tensor", "4")
    assert (plan.hybrid.tensor, plan.hybrid.ulysses, plan.hybrid.ring) == (4, 2, 1)
    assert plan.save_dir == Path("runs/tp2_cp2-u2r1t4")


def test_tensor_with_gradient_clipping_is_accepted(monkeypatch):
    plan = _plan(monkeypatch, 4, "--deepspeed", str(ROOT / "ds_configs" / "cp2.json"), "--tensor", "2")  # clips at 1.0
    assert plan.hybrid.tensor == 2


def test_tensor_with_indivisible_heads_or_world_is_one_readable_error(monkeypatch):
    with pytest.raises(preflight.RunConfigError, match="6 query heads are not divisible by tensor=4 x ulysses=1"):
        _plan(
            monkeypatch,
            4,
            "--deepspeed",
            str(ROOT / "ds_configs" / "tensor" / "tp2_cp2.json"),
            "--tensor",
            "4",
            "--ulysses",
            "1",
            "--heads",
            "6",
        )
    with pytest.raises(preflight.RunConfigError, match="x tensor=4 = 8 ranks do not divide the world size 4"):
        _plan(monkeypatch, 4, "--deepspeed", str(ROOT / "ds_configs" / "tensor" / "tp2_cp2.json"), "--tensor", "4")
