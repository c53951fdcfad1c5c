"""Kernels with a value head dim apart from q/k's (MLA) and with logit soft-capping (Gemma 2),
against float64 autograd math (tests/helpers/references/attention.py), and the choice of a kernel that can
soft-cap (auto picks one, a named kernel that cannot is refused)."""

import pytest
import torch

from hybridsp.kernels import choose_backend, get_kernel, resolve_kernel
from hybridsp.kernels._band import band_mask
from hybridsp.kernels._flash import FlashAttnKernel
from tests.helpers import flash_attn_standin as standin
from tests.helpers.flash_attn_standin import make_standin, with_varlen
from tests.helpers.references.attention import random_qkv, rel_err, sinks_reference_with_grads

TOLERANCE = 1e-5
DIMS = [(24, 16), (16, 24), (24, 13)]  # (q/k head dim, v head dim): narrower, wider, odd


def _kernel_errors(kernel, q, k, v, dout, *, causal, softcap=None, scale=0.3):
    extra = {} if softcap is None else {"softcap": softcap}
    out, lse = kernel.forward(q, k, v, causal=causal, softmax_scale=scale, **extra)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, **extra)
    expected = sinks_reference_with_grads(q, k, v, dout, causal=causal, softcap=softcap, softmax_scale=scale)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    return [rel_err(a, e) for a, e in zip([out, *grads], expected[:4])]


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_head_dim_apart_from_query_key_is_exact(backend, dtype):
    kernel = get_kernel(backend)
    for (d, dv), kv_heads, causal in [(dims, kv, (i + kv) % 2 == 0) for i, dims in enumerate(DIMS) for kv in (4, 1)]:
        q, k, v, dout = random_qkv(2, 11, 4, kv_heads, d, v_head_dim=dv, seed=d + dv, dtype=dtype)
        errors = _kernel_errors(kernel, q, k, v, dout, causal=causal)
        assert max(errors) < TOLERANCE, (d, dv, kv_heads, causal, errors)


def test_band_pieces_with_value_head_dim_match_float64():
    q, k, v, dout = random_qkv(2, 12, 4, 2, 24, v_head_dim=13, seed=5)
    k, v = k[:, :9], v[:, :9]
    for backend in ("torch", "reference"):
        kernel = get_kernel(backend)
        for band in [(0, None), (2, 5), (-3, 4), (None, 1)]:
            out, lse = kernel.forward_band(q, k, v, band=band, softmax_scale=0.25)
            grads = kernel.backward_band(dout, q, k, v, out, lse, band=band, softmax_scale=0.25)
            mask = band_mask(12, 9, band)
            ref_out = torch.einsum("bhqk,bkhd->bqhd", _band_probs(q, k, mask, 0.25), v.double().repeat_interleave(2, 2))
            assert rel_err(out, ref_out) < TOLERANCE, (backend, band)
            assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
            assert all(torch.isfinite(g).all() for g in grads)


def _band_probs(q, k, mask, scale):
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(2, 2)) * scale
    return scores.masked_fill(~mask, -torch.inf).softmax(-1).nan_to_num(0.0)  # [B, H, Sq, Sk]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_kernel_soft_caps_forward_and_backward(dtype):
    kernel = get_kernel("reference")
    assert kernel.supports_softcap and not get_kernel("torch").supports_softcap
    for softcap, causal, (d, dv) in [(2.0, True, (16, 16)), (0.5, False, (24, 13)), (30.0, True, (8, 8))]:
        q, k, v, dout = random_qkv(2, 10, 4, 2, d, v_head_dim=dv, seed=7, dtype=dtype)
        q = q * 3  # scores of a few units: the cap bends them
        errors = _kernel_errors(kernel, q, k, v, dout, causal=causal, softcap=softcap)
        assert max(errors) < TOLERANCE, (softcap, causal, errors)
        plain = kernel.forward(q, k, v, causal=causal, softmax_scale=0.3)[0]
        capped = kernel.forward(q, k, v, causal=causal, softmax_scale=0.3, softcap=softcap)[0]
        assert softcap > 10 or rel_err(capped, plain) > 1e-2  # the cap changed the result


def test_flash_adapter_soft_caps_and_pads_the_value_head_dim():
    q, k, v, dout = random_qkv(2, 12, 4, 2, 24, v_head_dim=16, seed=3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):  # flash-attn 2 (and the stand-in) want v with q's head dim
        standin._flash_attn_forward(q, k, v, 0.0, 0.3, False, -1, -1, 0.0, None, False)
    reference = get_kernel("reference")
    for version in ("2.8-opaque", "2.6"):
        kernel = FlashAttnKernel(make_standin(version))
        assert kernel.supports_softcap
        for softcap in (None, 1.5):
            extra = {} if softcap is None else {"softcap": softcap}
            out, lse = kernel.forward(q * 3, k, v, causal=True, softmax_scale=0.3, **extra)
            out_r, lse_r = reference.forward(q * 3, k, v, causal=True, softmax_scale=0.3, **extra)
            assert out.shape == (2, 12, 4, 16) and (out.float() - out_r.float()).abs().max() < 2e-2
            assert (lse - lse_r).abs().max() < 1e-3
            grads = kernel.backward(dout, q * 3, k, v, out, lse, causal=True, softmax_scale=0.3, **extra)
            grads_r = reference.backward(dout, q * 3, k, v, out_r, lse_r, causal=True, softmax_scale=0.3, **extra)
            for g, g_r in zip(grads, grads_r):
                assert g.shape == g_r.shape and (g.float() - g_r.float()).abs().max() < 5e-2, (version, softcap)
    assert not FlashAttnKernel(make_standin("2.5")).supports_softcap  # 2.4/2.5 have no softcap argument


def test_flash_varlen_soft_caps_with_value_head_dim():
    kernel = FlashAttnKernel(with_varlen(make_standin("2.8")))
    q, k, v, dout = random_qkv(1, 12, 4, 2, 24, v_head_dim=16, seed=4, dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    args = dict(
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7, window=(-1, 0), softmax_scale=0.3, softcap=2.0
    )
    out, lse = kernel.forward_varlen(q[0] * 3, k[0], v[0], **args)
    reference = get_kernel("reference")
    for rows in (slice(0, 5), slice(5, 12)):
        out_r, _ = reference.forward(
            q[:, rows] * 3, k[:, rows], v[:, rows], causal=True, softmax_scale=0.3, softcap=2.0
        )
        assert (out[rows].float() - out_r[0].float()).abs().max() < 2e-2
    grads = kernel.backward_varlen(dout[0], q[0] * 3, k[0], v[0], out, lse, **args)
    assert [g.shape for g in grads] == [q[0].shape, k[0].shape, v[0].shape]


def test_auto_picks_a_kernel_that_soft_caps_and_a_named_one_that_cannot_is_refused():
    assert choose_backend("cpu", torch.float32, 64, flash_installed=False, softcap=True) == "reference"
    assert choose_backend("cuda", torch.bfloat16, 64, flash_installed=True, softcap=True) == "flash"
    assert choose_backend("cuda", torch.float32, 64, flash_installed=True, softcap=True) == "reference"
    assert choose_backend("cuda", torch.bfloat16, 64, flash_installed=False, softcap=True) == "reference"
    assert choose_backend("cuda", torch.bfloat16, 192, flash_installed=True) == "flash"  # MLA's q/k head dim
    q = torch.zeros(1, 4, 2, 8)
    assert resolve_kernel("auto", q, softcap=50.0).name == "reference"
    assert resolve_kernel("auto", q).name == "torch"
    with pytest.raises(ValueError, match=r"softcap=50.0 needs a kernel that soft-caps.*'torch' kernel"):
        resolve_kernel("torch", q, softcap=50.0)


class _PlainKernel:
    """A user's kernel object with only forward/backward (the reference math), no softcap."""

    name = "plain"

    def forward(self, q, k, v, *, causal, softmax_scale, **extra):
        return get_kernel("reference").forward(q, k, v, causal=causal, softmax_scale=softmax_scale, **extra)

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale, **extra):
        return get_kernel("reference").backward(
            dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, **extra
        )


class _CappingKernel(_PlainKernel):
    name = "capping"
    supports_softcap = True


def test_user_kernels_declare_soft_capping_to_be_given_it():
    q, k, v, dout = random_qkv(1, 6, 2, 1, 8, seed=1)
    with pytest.raises(ValueError, match="'plain' kernel does not"):
        resolve_kernel(_PlainKernel(), q, softcap=3.0)
    kernel = resolve_kernel(_CappingKernel(), q, softcap=3.0)
    assert kernel.supports_softcap
    out, _ = kernel.forward_band(q * 4, k, v, band=(0, None), softmax_scale=0.5, softcap=3.0)
    expected = sinks_reference_with_grads(q * 4, k, v, dout, causal=True, softcap=3.0, softmax_scale=0.5)[0]
    assert rel_err(out, expected) < TOLERANCE


def test_math_kernels_chunk_query_rows_without_changing_the_result(monkeypatch):
    from hybridsp.kernels import _band as band_module

    kernel = get_kernel("reference")
    q, k, v, dout = random_qkv(2, 13, 4, 2, 16, v_head_dim=8, seed=8)
    for piece_band, softcap in [((0, None), 2.0), ((-2, 5), None)]:
        whole = kernel.forward_band(q, k, v, band=piece_band, softmax_scale=0.3, softcap=softcap)
        whole_grads = kernel.backward_band(dout, q, k, v, *whole, band=piece_band, softmax_scale=0.3, softcap=softcap)
        monkeypatch.setattr(band_module, "SCORE_BLOCK_BYTES", 4 * 2 * 4 * 13 * 3)  # three rows per chunk
        assert len(band_module.row_chunks(2, 4, 13, 13)) == 5
        chunked = kernel.forward_band(q, k, v, band=piece_band, softmax_scale=0.3, softcap=softcap)
        grads = kernel.backward_band(dout, q, k, v, *chunked, band=piece_band, softmax_scale=0.3, softcap=softcap)
        monkeypatch.undo()
        for a, b in zip([*chunked, *grads], [*whole, *whole_grads]):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
