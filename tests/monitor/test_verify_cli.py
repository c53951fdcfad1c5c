"""``python -m hybridsp verify``: a shrunk config checked on local ranks it starts itself, exit status 0 when
the probe passes and 1 when it fails (a tolerance no float32 run meets), 2 for a malformed option."""

from __future__ import annotations

import pytest

from hybridsp.__main__ import main

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

TINY = ["--config", "llama", "--layers", "1", "--set", "hidden_size=64", "--set", "intermediate_size=128"]
TINY += ["--set", "num_attention_heads=4", "--set", "num_key_value_heads=2", "--set", "vocab_size=256"]


@pytest.mark.slow
def test_a_shrunk_config_passes_and_an_impossible_tolerance_fails(capsys):
    assert main(["verify", *TINY, "--ring", "2", "--seq-len", "64", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "starting 2 local CPU ranks" in out and "PASS: worst" in out and "llama (llama," in out
    assert main(["verify", *TINY, "--ring", "2", "--seq-len", "64", "--rtol", "1e-12"]) == 1
    assert "FAIL: worst layer 0 out" in capsys.readouterr().out


def test_a_malformed_override_is_exit_status_2(capsys):
    assert main(["verify", "--config", "llama", "--set", "hidden_size"]) == 2
    assert "--set takes FIELD=VALUE" in capsys.readouterr().err
