"""Imported by the forkserver before it forks ranks (harness.warm_forkserver): loads the example's
``train`` and ``text_data`` modules (by path, :func:`benchmarks.common.example.example`), so that each
rank starts with them."""

from benchmarks.common.example import example

example("text_data")
example("train")
