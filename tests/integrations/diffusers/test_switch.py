"""The diffusers switch against the unmodified transformer: output and every parameter gradient.

Each case runs the tiny random transformer unmodified in float64 (the reference) and in the case's
dtype on one process, and switched on a Ulysses x ring mesh; the switched errors against float64 must
be at most twice the one-process errors (flash-attn's rule for bf16; fp32 the same), with odd token
counts (pads inside), B = 2 and both non-causal layouts. The default run takes one launch of two
representative cases; the full matrix (3 families x U2xR1, U1xR2, U2xR2 x fp32, bf16) is ``slow``.
"""

from __future__ import annotations

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
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


def test_qwen_rows_with_different_text_masks():
    """Prompts of different lengths in one batch (row i hides 1 + i of 7 text tokens): run row by row,
    output and gradients as the unmodified model's, at U1 x R2 and U2 x R1 (fp32)."""
    _check(
        [
            ("qwen", 1, 2, "float32", "contiguous", 3, 11, 7, 1, True),
            ("qwen", 2, 1, "float32", "zigzag", 2, 9, 5, 1, True),
        ],
        2,
    )


def test_wan_per_token_timesteps():
    """Wan 2.2 TI2V's timestep per latent token ([B, L]): the time embeddings are cut with the tokens, output and
    gradients as the unmodified model's (15 tokens, odd, at U1 x R2 and U2 x R1, fp32; bf16 in the slow set)."""
    cases = [("wan", 1, 2, "float32", "contiguous", 2, 15, 5, 0, False, True)]
    _check(cases + [("wan", 2, 1, "float32", "zigzag", 2, 15, 5, 0, False, True)], 2)


@pytest.mark.slow
def test_wan_per_token_timesteps_bf16_and_u2r2():
    _check([("wan", 2, 2, "bfloat16", "zigzag", 2, 15, 5, 0, False, True)], 4)


def test_qwen_image_edit_zero_cond_t():
    """Qwen-Image edit models' ``zero_cond_t``: the condition image's tokens are modulated as at timestep 0 (a
    per-token index cut with the tokens); output and gradients as the unmodified model's at U1 x R2 and U2 x R2."""
    cases = [("qwen_edit", 1, 2, "float32", "contiguous", 2, 17, 5), ("qwen_edit", 2, 2, "float32", "zigzag", 1, 13, 4)]
    _check(cases, 4)


def test_the_switch_refuses_what_it_cannot_make_exact():
    pytest.importorskip("diffusers")
    from hybridsp.integrations import diffusers as hybrid_diffusers
    from tests.helpers.models.diffusion import tiny_transformer

    model = tiny_transformer("flux", heads=3)
    with pytest.raises(ValueError, match="3 heads, which ulysses=2"):
        hybrid_diffusers.apply(model, mesh_at(2, 1))
    model = tiny_transformer("flux", heads=2)
    with pytest.raises(ValueError, match="layout='balanced'"):
        hybrid_diffusers.apply(model, mesh_at(1, 2, layout="balanced"))

    class OtherProcessor:
        pass

    model.transformer_blocks[0].attn.processor = OtherProcessor()
    with pytest.raises(ValueError, match="OtherProcessor, which the switch does not know"):
        hybrid_diffusers.apply(model, mesh_at(1, 2))
    with pytest.raises(ValueError, match="not a transformer the diffusers switch knows"):
        hybrid_diffusers.apply(torch.nn.Linear(2, 2), mesh_at(1, 2))


def test_apply_and_undo_restore_processors_and_dispatch():
    pytest.importorskip("diffusers")
    import diffusers.models.transformers.transformer_wan as wan_module

    from hybridsp.integrations import diffusers as hybrid_diffusers
    from tests.helpers.models.diffusion import tiny_transformer, transformer_inputs

    model = tiny_transformer("wan", heads=2, layers=1)
    inputs = transformer_inputs("wan", batch=1, tokens=5, text=3)
    before = model(**inputs).sample
    dispatch = wan_module.dispatch_attention_fn
    first = hybrid_diffusers.apply(model, mesh_at(1, 1))
    second_model = tiny_transformer("wan", heads=2, layers=1)
    second = hybrid_diffusers.apply(second_model, mesh_at(1, 1))
    torch.testing.assert_close(model(**inputs).sample, before, rtol=0, atol=1e-5)  # a 1 x 1 mesh: one rank
    first.undo()
    assert wan_module.dispatch_attention_fn is not dispatch  # the second switch still routes
    second.undo()
    second.undo()  # idempotent
    assert wan_module.dispatch_attention_fn is dispatch
    assert all(proc._parallel_config is None for proc in model.attn_processors.values())
    assert torch.equal(model(**inputs).sample, before)
