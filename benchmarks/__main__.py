"""The benchmarks' runner.

    python -m benchmarks list                          # every benchmark: name, results folder, question
    python -m benchmarks run NAME [ARGS ...]           # the full run (writes the committed results)
    python -m benchmarks run NAME --quick [ARGS ...]   # its small run, into a temporary folder
    python -m benchmarks run NAME --help               # the benchmark's own options

NAME is a registry name (``attention.peers``) or its last part when that is unique (``peers``). ARGS
go to the benchmark as they are (after the quick options, so they override them). ``--quick`` runs
the script's own small-run options (``benchmarks/_registry.py``) with its outputs in a fresh temporary
folder, and points ``$BENCHMARKS_RESULTS`` there too, so that it never writes over committed results.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time

from benchmarks._registry import BENCHMARKS, Benchmark, find

PACKAGE = os.path.dirname(os.path.abspath(__file__))
RESULTS_ENV = "BENCHMARKS_RESULTS"  # read by benchmarks.common.harness.results_root


def list_benchmarks(out=None) -> None:
    """Print one line per benchmark: name, results folder, question."""
    out = out or sys.stdout
    width = max(len(b.name) for b in BENCHMARKS)
    folder = max(len(b.results) for b in BENCHMARKS) + 1
    print(f"{'NAME':<{width}}  {'RESULTS':<{folder}}  QUESTION", file=out)
    for b in BENCHMARKS:
        print(f"{b.name:<{width}}  {b.results + '/':<{folder}}  {b.question}", file=out)


def quick_argv(benchmark: Benchmark, tmp: str) -> list[str]:
    """The benchmark's small-run options with ``{tmp}`` and ``{root}`` filled in."""
    root = os.path.dirname(PACKAGE)
    return [arg.format(tmp=tmp, root=root) for arg in benchmark.quick]


def run(name: str, args: list[str]) -> int:
    """Run a benchmark's ``main`` in this process; ``--quick`` among ``args`` selects its small run."""
    benchmark = find(name)
    quick = "--quick" in args
    args = [a for a in args if a != "--quick"]
    if quick:
        tmp = tempfile.mkdtemp(prefix=f"benchmarks-{benchmark.name.replace('.', '-')}-")
        os.environ[RESULTS_ENV] = tmp
        args = quick_argv(benchmark, tmp) + args
        print(f"quick run of {benchmark.name}; its results go to {tmp}", flush=True)
    print(f"python -m {benchmark.module} {' '.join(args)}".rstrip(), flush=True)
    started = time.perf_counter()
    status = importlib.import_module(benchmark.module).main(args)
    status = status if isinstance(status, int) else 0
    print(
        f"{benchmark.name}: exit status {status} after {time.perf_counter() - started:.0f} s"
        + (f"; results in {tmp}" if quick else ""),
        flush=True,
    )
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "list" and len(argv) == 1:
        list_benchmarks()
        return 0
    if argv[0] == "run" and len(argv) >= 2:
        try:
            return run(argv[1], argv[2:])
        except KeyError as error:
            print(error.args[0], file=sys.stderr)
            return 2
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
