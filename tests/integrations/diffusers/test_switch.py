"""The diffusers switch against the unmodified transformer: output and every parameter gradient.

Each case runs the tiny random transformer unmodified in float64 (the reference) and in the case's
dtype on one process, and switched on a Ulysses x ring mesh; the switched errors against float64 must
be at most twice the one-process errors (flash-attn's rule for bf16; fp32 the same), with odd token
counts (pads inside), B = 2 and both non-causal layouts. The default run takes one launch of two
representative cases; the full matrix (3 families x U2xR1, U1xR2, U2xR2 x fp32, bf16) is ``slow``.
"""

from __future__ import annotations

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.preload import preload
from tests.helpers.workers.diffusion import parity_cases

pytest.importorskip("diffusers")
pytestmark = [pytest.mark.distributed, pytest.mark.integration]

SLACK = {"float32": 1e-6, "bfloat16": 1e-3}  # relative to the largest reference value


def _check(cases: list[tuple], world: int) -> None:
    preload(
        "diffusers", "diffusers.models.transformers.transformer_wan", "diffusers.models.transformers.transformer_flux"
    )
    results = run_distributed(parity_cases, world, cases, timeout=800)[0]
    for case, errors in zip(cases, results):
        dtype = case[3]
        for what in ("out", "grad"):
            single, switched = errors["single"][what], errors["switched"][what]
            assert switched <= 2 * single + SLACK[dtype], (
                f"{case}: {what} error {switched:.3g} vs one process {single:.3g}"
            )


def test_wan_and_flux_switched_equal_the_unmodified_model():
    _check([("wan", 2, 2, "float32", "zigzag", 2, 15, 5), ("flux", 1, 2, "bfloat16", "contiguous", 2, 13, 5)], 4)


MESHES = [(2, 1), (1, 2), (2, 2)]
MATRIX = [
    (family, u, r, dtype, layout, 2, tokens, 5)
    for family, layout, tokens in (("wan", "contiguous", 15), ("flux", "zigzag", 13), ("qwen", "contiguous", 17))
    for u, r in MESHES
    for dtype in ("float32", "bfloat16")
]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["wan", "flux", "qwen"])
def test_full_matrix(family):
    _check([case for case in MATRIX if case[0] == family], 4)


@pytest.mark.slow
def test_qwen_text_mask_and_odd_text():
    _check([("qwen", 2, 2, "float32", "zigzag", 2, 11, 7, 3), ("qwen", 1, 2, "bfloat16", "contiguous", 1, 9, 4, 1)], 4)
