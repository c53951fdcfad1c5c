"""FlashAttnKernel (hybridsp.kernels._flash) against a CPU stand-in for flash-attn's low-level API.

The stand-in (tests/helpers/flash_attn_standin.py) is not flash-attn: it copies flash-attn's
signatures and conventions with fp32 torch math, so these tests check the adapter's
plumbing (padding, GQA, lse conventions, version shims), not flash-attn's numerics.
"""

import inspect
import math
import subprocess
import sys

import pytest
import torch

from hybridsp.kernels._flash import FlashAttnKernel
from hybridsp.kernels._reference import ReferenceKernel
from tests.helpers import flash_attn_standin as standin
from tests.helpers.paths import ROOT

ATOL = RTOL = 2e-2  # bf16 outputs: one bf16 ulp is ~0.4% of the value


def _qkv(batch, sq, sk, heads, kv_heads, head_dim, dtype=torch.bfloat16, seed=0):
    """Random q [B, Sq, H, D], k/v [B, Sk, Hkv, D], dout [B, Sq, H, D] in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return (
        rand(batch, sq, heads, head_dim),
        rand(batch, sk, kv_heads, head_dim),
        rand(batch, sk, kv_heads, head_dim),
        rand(batch, sq, heads, head_dim),
    )


def _close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _check_against_reference(kernel, q, k, v, dout, causal):
    """Forward and backward of ``kernel`` on half inputs vs ReferenceKernel on their fp32 upcast."""
    scale = 1 / math.sqrt(q.shape[-1])
    ref = ReferenceKernel()
    q32, k32, v32, dout32 = (x.float() for x in (q, k, v, dout))
    ref_out, ref_lse = ref.forward(q32, k32, v32, causal=causal, softmax_scale=scale)
    ref_grads = ref.backward(dout32, q32, k32, v32, ref_out, ref_lse, causal=causal, softmax_scale=scale)

    out, lse = kernel.forward(q, k, v, causal=causal, softmax_scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    _close(out, ref_out)
    _close(lse, ref_lse, atol=1e-3, rtol=1e-3)

    # backward receives the final out (in the input dtype) and lse, as in ring attention
    grads = kernel.backward(dout, q, k, v, ref_out.to(q.dtype), ref_lse, causal=causal, softmax_scale=scale)
    for grad, like, expected in zip(grads, (q, k, v), ref_grads):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        _close(grad, expected)


IMPORT_PROBE = (
    "import sys, hybridsp, hybridsp.kernels, hybridsp.kernels._flash\n"
    "assert 'flash_attn' not in sys.modules, sorted(m for m in sys.modules if 'flash' in m)\n"
)


@pytest.fixture(scope="module", autouse=True)
def import_probe():
    """A fresh interpreter that imports hybridsp; started first so it runs alongside the other tests."""
    probe = subprocess.Popen(  # `python -c` puts the cwd, the repo root, on sys.path
        [sys.executable, "-c", IMPORT_PROBE], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    yield probe
    if probe.poll() is None:
        probe.kill()
    probe.communicate()


@pytest.fixture(scope="module")
def kernel():
    return FlashAttnKernel(interface=standin)


@pytest.mark.parametrize("head_dim", [64, 80, 36])  # 36 is not a multiple of 8: padded
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(kernel, causal, heads, kv_heads, head_dim):
    q, k, v, dout = _qkv(2, 32, 32, heads, kv_heads, head_dim, seed=head_dim + kv_heads)
    _check_against_reference(kernel, q, k, v, dout, causal)


def test_non_square_non_causal_and_fp16(kernel):
    q, k, v, dout = _qkv(2, 24, 40, 4, 2, 80, dtype=torch.float16, seed=3)
    _check_against_reference(kernel, q, k, v, dout, causal=False)


FAST_VERSIONS = [v for v in standin.VERSIONS if v != "2.8-custom-op"]


@pytest.mark.parametrize("version", FAST_VERSIONS)
def test_every_calling_convention(version):
    kernel = FlashAttnKernel(interface=standin.make_standin(version))
    assert kernel.name == "flash"
    assert kernel.interface_style == ("2.7+" if version.startswith("2.8") else "2.4-2.6")
    q, k, v, dout = _qkv(2, 32, 32, 4, 2, 36, seed=7)
    _check_against_reference(kernel, q, k, v, dout, causal=True)


def test_custom_op_signature_is_read_through_the_wrapper():
    """flash-attn >= 2.7 on torch >= 2.4 exposes custom ops whose signature is (*args, **kwargs)."""
    fake = standin.make_standin("2.8-custom-op")
    assert "(*args, **kwargs)" in str(inspect.signature(fake._flash_attn_forward))
    kernel = FlashAttnKernel(interface=fake)
    assert kernel._calls.forward_signature.names == tuple(inspect.signature(standin._flash_attn_forward).parameters)
    assert kernel._calls.backward_signature.names == tuple(inspect.signature(standin._flash_attn_backward).parameters)


@pytest.mark.slow  # the first call through a torch custom op imports ~800 modules (~2 s)
def test_calls_through_torch_custom_ops():
    kernel = FlashAttnKernel(interface=standin.make_standin("2.8-custom-op"))
    q, k, v, dout = _qkv(2, 32, 32, 4, 2, 36, seed=7)
    _check_against_reference(kernel, q, k, v, dout, causal=True)


def test_strided_last_dim_inputs(kernel):
    base = _qkv(2, 16, 16, 4, 2, 128, seed=5)
    q, k, v, dout = (x[..., ::2] for x in base)  # [B, S, H, 64] with stride(-1) == 2
    assert q.stride(-1) == 2
    _check_against_reference(kernel, q, k, v, dout, causal=True)


# --------------------------------------------------------------------------- lse conventions


def test_standin_marks_rows_without_keys_with_pos_inf():
    """flash-attn's own convention, which the adapter must undo: bottom-right causal, lse +inf."""
    q, k, v, _ = _qkv(1, 6, 4, 2, 2, 16)
    out, lse, _, _ = standin._flash_attn_forward(q, k, v, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    assert torch.isposinf(lse[..., :2]).all() and torch.isfinite(lse[..., 2:]).all()
    assert (out[:, :2] == 0).all()


def test_forward_turns_pos_inf_lse_into_neg_inf():
    """A row that flash-attn reports as seeing no key (+inf) must come back as -inf."""
    calls = standin.make_standin("2.8")

    def forward_with_empty_row(*args):
        out, lse, s_dmask, rng = standin._flash_attn_forward(*args)
        out[:, 0], lse[..., 0] = 0, math.inf
        return out, lse, s_dmask, rng

    calls._flash_attn_forward = forward_with_empty_row
    q, k, v, _ = _qkv(2, 8, 8, 4, 2, 64)
    out, lse = FlashAttnKernel(interface=calls).forward(q, k, v, causal=False, softmax_scale=0.125)
    assert torch.isneginf(lse[..., 0]).all() and torch.isfinite(lse[..., 1:]).all()
    assert (out[:, 0] == 0).all()


def test_backward_turns_neg_inf_lse_into_pos_inf():
    """The protocol's -inf rows reach flash-attn as +inf and get zero gradients."""
    calls, seen = standin.make_standin("2.8"), {}

    def spy(*args):
        seen["lse"] = args[5].clone()
        return standin._flash_attn_backward(*args)

    calls._flash_attn_backward = spy
    q, k, v, dout = _qkv(2, 8, 8, 4, 2, 64, seed=2)
    ref = ReferenceKernel()
    out, lse = ref.forward(q, k, v, causal=False, softmax_scale=0.125)
    lse[..., 3] = -math.inf  # this row saw no key anywhere
    out[:, 3] = 0
    dq, dk, dv = FlashAttnKernel(interface=calls).backward(dout, q, k, v, out, lse, causal=False, softmax_scale=0.125)
    assert torch.isposinf(seen["lse"][..., 3]).all()
    assert (dq[:, 3] == 0).all()
    assert all(torch.isfinite(g.float()).all() for g in (dq, dk, dv))
    ref_grads = ref.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=0.125)
    for grad, expected in zip((dq, dk, dv), ref_grads):
        _close(grad, expected)


def test_empty_key_block(kernel):
    q, k, v, dout = _qkv(2, 8, 0, 4, 2, 64)
    out, lse = kernel.forward(q, k, v, causal=False, softmax_scale=0.125)
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (2, 4, 8)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=0.125)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


# --------------------------------------------------------------------------- refusals


def test_fp32_is_refused_with_a_hint(kernel):
    q, k, v, dout = _qkv(1, 8, 8, 2, 2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"fp16 or bf16.*backend='torch'"):
        kernel.forward(q, k, v, causal=False, softmax_scale=0.125)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match=r"fp16 or bf16"):
        kernel.backward(dout, q, k, v, q, lse, causal=False, softmax_scale=0.125)


def test_real_flash_attn_refuses_cpu_tensors():
    kernel = FlashAttnKernel(interface=standin)
    kernel._require_cuda = True  # what FlashAttnKernel() sets for the real flash-attn
    q, k, v, _ = _qkv(1, 8, 8, 2, 2, 64)
    with pytest.raises(ValueError, match=r"CUDA only.*backend='torch'"):
        kernel.forward(q, k, v, causal=False, softmax_scale=0.125)


def test_head_dim_over_256_is_refused(kernel):
    q, k, v, _ = _qkv(1, 4, 4, 2, 2, 260)
    with pytest.raises(ValueError, match="up to 256"):
        kernel.forward(q, k, v, causal=False, softmax_scale=0.125)


def test_standin_refuses_what_flash_attn_refuses():
    q, k, v, _ = _qkv(1, 8, 8, 2, 2, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        standin._flash_attn_forward(q, k, v, 0.0, 0.125, False, -1, -1, 0.0, None, False)
    q, k, v, _ = _qkv(1, 8, 8, 2, 2, 36)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        standin._flash_attn_forward(q, k, v, 0.0, 0.125, False, -1, -1, 0.0, None, False)
    q, k, v, dout = _qkv(1, 8, 8, 2, 2, 64)
    out, lse, _, _ = standin._flash_attn_forward(q, k, v, 0.0, 0.125, False, -1, -1, 0.0, None, False)
    strided = torch.empty(1, 8, 2, 128, dtype=q.dtype)[..., ::2]
    with pytest.raises(RuntimeError, match="dq must have contiguous last dimension"):
        standin._flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            strided,
            torch.empty_like(k),
            torch.empty_like(v),
            0.0,
            0.125,
            False,
            -1,
            -1,
            0.0,
            None,
            False,
        )


def test_standin_signatures_match_flash_attn_2_8():
    forward = [
        "q",
        "k",
        "v",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "softcap",
        "alibi_slopes",
        "return_softmax",
    ]
    backward = [
        "dout",
        "q",
        "k",
        "v",
        "out",
        "softmax_lse",
        "dq",
        "dk",
        "dv",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "softcap",
        "alibi_slopes",
        "deterministic",
        "rng_state",
    ]
    assert list(inspect.signature(standin._flash_attn_forward).parameters) == forward
    assert list(inspect.signature(standin._flash_attn_backward).parameters) == backward


def test_unknown_interface_is_refused():
    def forward(q, k, v, softmax_scale, causal, brand_new_option):
        raise AssertionError("not reached")

    fake = standin.make_standin("2.8")
    fake._flash_attn_forward = forward
    kernel = FlashAttnKernel(interface=fake)
    q, k, v, _ = _qkv(1, 8, 8, 2, 2, 64)
    with pytest.raises(RuntimeError, match="brand_new_option"):
        kernel.forward(q, k, v, causal=False, softmax_scale=0.125)


def test_missing_flash_attn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn...` fail
    monkeypatch.delitem(sys.modules, "flash_attn.flash_attn_interface", raising=False)
    with pytest.raises(ImportError, match=r"pip install hybridsp\[flash\]"):
        FlashAttnKernel()


def test_importing_hybridsp_does_not_import_flash_attn(import_probe):
    _, stderr = import_probe.communicate(timeout=300)  # catches a hang
    assert import_probe.returncode == 0, stderr
