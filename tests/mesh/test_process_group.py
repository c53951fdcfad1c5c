"""hybridsp.launch._process_group: a world of one without a launcher, the collective timeout reaching the groups."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridsp.launch._process_group import init_process_group, single_process_environment
from tests.helpers.paths import ROOT


def test_a_world_of_one_only_where_no_launcher_set_one():
    env = {}
    assert single_process_environment(env)
    assert (env["WORLD_SIZE"], env["RANK"], env["MASTER_ADDR"]) == ("1", "0", "127.0.0.1") and int(env["MASTER_PORT"])
    launched = {"WORLD_SIZE": "4", "RANK": "2"}
    assert not single_process_environment(launched) and launched == {"WORLD_SIZE": "4", "RANK": "2"}


def test_a_timeout_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="positive number of seconds; got 0"):
        init_process_group(0)


def test_the_timeout_reaches_the_default_group_and_the_mesh_groups():
    code = (
        "from hybridsp.launch._process_group import init_process_group\n"
        "from hybridsp.launch._timeouts import default_group_timeout\n"
        "import hybridsp, torch.distributed as dist\n"
        "init_process_group(7.0, backend='gloo'); hybridsp.init_mesh(1, 1)\n"
        "print(dist.get_world_size(), default_group_timeout().total_seconds())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["1", "7.0"]
