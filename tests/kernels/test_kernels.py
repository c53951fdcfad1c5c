import math

import pytest
import torch

from hybridsp.kernels import get_kernel
from hybridsp.kernels._reference import attention_in_input_dtype
from tests.helpers.references.attention import random_qkv, reference_with_grads, rel_err

CASES = [  # (heads, kv_heads, head_dim, causal)
    (4, 4, 64, False),
    (4, 4, 64, True),
    (4, 2, 128, True),
    (4, 1, 80, False),
    (6, 2, 80, True),
]


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,causal", CASES)
def test_kernel_matches_float64_reference(backend, heads, kv_heads, head_dim, causal):
    q, k, v, dout = random_qkv(2, 24, heads, kv_heads, head_dim, seed=1)
    kernel = get_kernel(backend)
    scale = 1 / math.sqrt(head_dim)
    out, lse = kernel.forward(q, k, v, causal=causal, softmax_scale=scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale)
    ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(q, k, v, dout, causal=causal)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert lse.shape == (2, heads, 24) and dk.shape == k.shape
    for actual, expected in [(out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)]:
        assert rel_err(actual, expected) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_lse_is_logsumexp_of_scores(backend):
    q, k, v, _ = random_qkv(1, 16, 2, 2, 32, seed=2)
    _, lse = get_kernel(backend).forward(q, k, v, causal=True, softmax_scale=0.3)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.3
    scores = scores.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), -math.inf)
    assert rel_err(lse, torch.logsumexp(scores, -1)) < 1e-6


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_rows_without_keys_give_zeros_and_finite_grads(backend):
    q, k, v, dout = random_qkv(1, 8, 2, 2, 16, seed=3)
    kernel = get_kernel(backend)
    out, lse = kernel.forward(q, k[:, :0], v[:, :0], causal=False, softmax_scale=0.25)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()
    # A row whose *final* lse is -inf (it saw no key anywhere) must get zero gradient.
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=False, softmax_scale=0.25)
    for grad in (dq, dk, dv):
        assert torch.isfinite(grad).all() and grad.abs().max() == 0


def test_causal_refuses_non_square_blocks():
    q, k, v, _ = random_qkv(1, 8, 2, 2, 16)
    with pytest.raises(ValueError, match="8 queries and 4 keys"):
        get_kernel("torch").forward(q, k[:, :4], v[:, :4], causal=True, softmax_scale=1.0)


def test_bad_shapes_are_value_errors():
    q, k, v, _ = random_qkv(1, 8, 3, 2, 16)
    with pytest.raises(
        ValueError, match=r"query heads \(3, q's dim 2\) must be a multiple of key/value heads \(2, .*H_kv dividing H"
    ):
        get_kernel("torch").forward(q, k, v, causal=False, softmax_scale=1.0)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_kernel("cudnn")


def test_auto_picks_torch_without_cuda():
    assert get_kernel("auto", device=torch.device("cpu"), dtype=torch.bfloat16).name == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_low_precision_error_at_most_twice_same_dtype_math(dtype, kv_heads):
    """flash-attn's rule, on the torch kernel: fp16/bf16 error <= 2x plain math in that dtype."""
    q, k, v, dout = (t.to(dtype) for t in random_qkv(2, 64, 8, kv_heads, 64, seed=4))
    kernel, scale = get_kernel("torch"), 1 / 8
    out, lse = kernel.forward(q, k, v, causal=True, softmax_scale=scale)
    results = (out, *kernel.backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale))
    truth = reference_with_grads(q, k, v, dout, causal=True)
    same_dtype = attention_in_input_dtype(q, k, v, dout, causal=True, softmax_scale=scale)
    for actual, yardstick, expected in zip(results, same_dtype, truth):
        assert rel_err(actual, expected) <= 2 * rel_err(yardstick, expected)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_torch_kernel_bf16_same_on_heads_first_and_seq_first_storage(kv_heads):
    """bf16 CPU kernel: q/k/v/dout as [B, S, H, D] views of heads-first storage (what the Ulysses
    all-to-all hands out; used without a copy) give bitwise the results of [B, S, H, D] storage
    (which is copied to dense planes), and both are close to float64."""
    from hybridsp.kernels._torch_fused import heads_first_dense

    q, k, v, dout = (t.bfloat16() for t in random_qkv(2, 40, 4, kv_heads, 32, seed=7))
    heads_first = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout)]  # [B, S, H, D] views
    assert heads_first_dense(heads_first[0]).data_ptr() == heads_first[0].data_ptr()  # no copy
    assert heads_first_dense(q).is_contiguous() and heads_first_dense(q[:, ::2]).is_contiguous()
    kernel, results = get_kernel("torch"), []
    for qq, kk, vv, dd in (heads_first, (q, k, v, dout)):
        out, lse = kernel.forward(qq, kk, vv, causal=True, softmax_scale=0.2)
        results.append((out, lse, *kernel.backward(dd, qq, kk, vv, out, lse, causal=True, softmax_scale=0.2)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    expected = reference_with_grads(q, k, v, dout, causal=True, softmax_scale=0.2)  # float64
    for got, exp in zip((results[1][0], *results[1][2:]), expected):
        assert rel_err(got, exp) < 2e-2  # bf16 inputs and outputs (8 mantissa bits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("call", ["causal", "dense", "band"])
def test_torch_kernel_nan_row_of_a_short_block_is_nan_other_rows_bitwise_unchanged(dtype, call):
    """Note [NaN rows] in hybridsp.kernels._torch_fused: fewer keys than one vector (4 here), a NaN query row
    (and a row whose only key is NaN) came back out 0 / lse 0 from aten; now NaN, every other row the same bits."""
    kernel = get_kernel("torch")
    q, k, v, _ = random_qkv(1, 4, 4, 2, 8, seed=5, dtype=dtype)
    q[0, 2, 1, 3] = float("nan")  # query row 2, head 1
    k[0, 0, 1, 5] = float("nan")  # key 0 of K/V head 1 (heads 2, 3): causal row 0 sees only it
    band = {"causal": (0, None), "dense": (None, None), "band": (0, 1)}[call]
    if call == "band":
        out, lse = kernel.forward_band(q, k, v, band=band, softmax_scale=0.3)
    else:
        out, lse = kernel.forward(q, k, v, causal=call == "causal", softmax_scale=0.3)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    mask = (
        None
        if call != "band"
        else torch.zeros(4, 4, dtype=dtype).masked_fill_(
            ~torch.tensor([[0 <= i - j <= 1 for j in range(4)] for i in range(4)]), -torch.inf
        )
    )
    raw_out, raw_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        t(q), t(k), t(v), 0.0, call == "causal", attn_mask=mask, scale=0.3
    )[:2]
    nan_rows = torch.zeros(1, 4, 4, dtype=torch.bool)  # [B, S, H]
    nan_rows[0, 2, 1] = True
    if call != "dense":
        nan_rows[0, 0, 2:] = True  # row 0 sees key 0 only (dense rows see finite keys too: NaN already)
    assert torch.equal(torch.isnan(out).any(-1), nan_rows | torch.isnan(t(raw_out)).any(-1))
    assert torch.equal(torch.isnan(lse), t(nan_rows) | torch.isnan(raw_lse))
    keep = ~nan_rows
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(out[keep], t(raw_out)[keep], **exact)
    torch.testing.assert_close(lse[t(keep)], raw_lse.to(lse.dtype)[t(keep)], **exact)


def _qkv_variants():
    """(name, q, k, v, causal) calls that check_qkv must refuse, each one thing wrong."""
    q, k, v, _ = random_qkv(2, 8, 4, 2, 16)
    return [
        ("k not a tensor", q, k.tolist(), v, False),
        ("3-D q", q[0], k, v, False),
        ("mixed dtypes", q, k.double(), v, False),
        ("mixed devices", q, k.to("meta"), v.to("meta"), False),
        ("integer tensors", q.long(), k.long(), v.long(), False),
        ("batch differs", q[:1], k, v, False),
        ("k/v tokens differ", q, k, v[:, :4], False),
        ("k/v heads differ", q, k, v[:, :, :1], False),
        ("head dims of q and k differ", q[..., :8], k, v, False),
        ("empty value head dim", q, k, v[..., :0], False),
        ("query heads not a multiple", q[:, :, :3], k, v, False),
        ("no K/V heads", q, k[:, :, :0], v[:, :, :0], False),
        ("causal, not square", q, k[:, :4], v[:, :4], True),
    ]


@pytest.mark.parametrize("case", range(len(_qkv_variants())), ids=[c[0] for c in _qkv_variants()])
def test_check_qkv_refuses_each_bad_call(case):
    from hybridsp.kernels import check_qkv

    _, q, k, v, causal = _qkv_variants()[case]
    with pytest.raises(ValueError):
        check_qkv(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_check_qkv_accepts_valid_calls(causal):
    from hybridsp.kernels import check_qkv

    q, k, v, _ = random_qkv(2, 8, 4, 1, 16)
    check_qkv(q, k, v, causal=causal)  # GQA down to one K/V head
    check_qkv(q.transpose(1, 2).contiguous().transpose(1, 2), k, v[..., :5], causal=causal)  # strided q, Dv < D
    if not causal:
        check_qkv(q, k[:, :3], v[:, :3], causal=False)  # fewer keys than queries


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lse_maps_match_their_elementwise_definitions(dtype):
    from hybridsp.kernels._base import lse_for_backward, no_key_lse_to_neg_inf

    lse = torch.tensor([-math.inf, math.inf, math.nan, -3.5, 0.0, 2.25], dtype=dtype).view(1, 2, 3)
    backward = lse_for_backward(lse)
    merged = no_key_lse_to_neg_inf(lse)
    for got, want in (
        (backward, [math.inf, math.inf, math.nan, -3.5, 0.0, 2.25]),
        (merged, [-math.inf, -math.inf, math.nan, -3.5, 0.0, 2.25]),
    ):
        assert got.dtype == dtype and got.shape == lse.shape
        torch.testing.assert_close(got.flatten(), torch.tensor(want, dtype=dtype), equal_nan=True, rtol=0, atol=0)
