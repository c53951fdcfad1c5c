"""Run a benchmark's worker under another checkout's hybridsp (the before / after comparisons).

A worker is a benchmark module run as ``python -m benchmarks.<group>.<name> --worker ...`` in a
subprocess whose ``hybridsp`` comes from the tree under test (a worktree of an earlier revision, or
this checkout) while ``benchmarks`` is always this checkout's: the subprocess starts in a scratch
folder that holds only a link to this ``benchmarks/`` (``python -m`` puts its working folder first on
the path), with ``PYTHONPATH`` the tree. The worker prints its JSON answer as its last stdout line,
with ``"hybridsp": hybridsp.__file__`` so that :func:`tree_result` can check which hybridsp ran.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import PACKAGE


@functools.lru_cache(maxsize=None)
def _launch_folder() -> str:
    """A scratch folder holding only ``benchmarks`` -> this checkout's package (removed at exit)."""
    folder = tempfile.mkdtemp(prefix="benchmarks-tree-")
    os.symlink(PACKAGE, os.path.join(folder, "benchmarks"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def tree_process(module: str, tree: str, *argv: str) -> dict:
    """``subprocess`` keywords (args, env, cwd) that run ``python -m module argv`` under ``tree``'s hybridsp."""
    return {
        "args": [sys.executable, "-m", module, *argv],
        "env": {**os.environ, "PYTHONPATH": tree},
        "cwd": _launch_folder(),
    }


def tree_result(tree: str, what: str, returncode: int, stdout: str, stderr: str) -> dict:
    """The JSON last line a worker printed (with ``"hybridsp"``: its ``hybridsp.__file__``);
    RuntimeError when it failed or imported hybridsp from outside ``tree``."""
    if returncode != 0:
        raise RuntimeError(f"{what} in {tree} failed:\n{stderr[-3000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    if not Path(result["hybridsp"]).resolve().is_relative_to(Path(tree).resolve()):
        raise RuntimeError(f"{what} in {tree}: imported hybridsp from {result['hybridsp']}")
    return result


def run_in_tree(module: str, tree: str, *argv: str, what: str, timeout: float) -> dict:
    """Run a worker to its end (:func:`tree_process`) and return its checked answer (:func:`tree_result`).
    On a timeout the worker's whole process group (its gloo ranks too) is killed."""
    process = subprocess.Popen(
        **tree_process(module, tree, *argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return tree_result(tree, what, process.returncode, stdout, stderr)


def tree_head(tree: str) -> str:
    """The short commit a tree has checked out ("unknown" outside git)."""
    done = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"
