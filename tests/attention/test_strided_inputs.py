"""Inputs users really pass: strided views, fp64 (gradcheck), and bad input refused before any collective."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import hybridsp
from hybridsp import CommCounter, hybrid_attn_func, init_mesh, ring_attention
from hybridsp.kernels import choose_backend, get_kernel
from hybridsp.kernels.torch_fused import cuda_backward, cuda_forward, cuda_variant
from hybridsp.testing import run_distributed
from tests.helpers.reference import random_qkv, reference_with_grads, rel_err

# --------------------------------------------------------------------------- strided views


def _strided_views(q, k, v):
    """The same values as (q, k, v) [B, S, H, D] through views whose strides users produce."""
    b, s, h, d = q.shape
    hkv = k.shape[2]

    def transposed(x):  # last dim stride H: y.view(B, S, D, H).transpose(-1, -2)
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    def every_other(x):  # last dim stride 2: a slice x[..., ::2] of a wider tensor
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
        wide[..., ::2] = x
        return wide[..., ::2]

    def fused_qkv():  # q, k, v sliced out of one packed projection [B, S, H + 2 Hkv, D]
        packed = torch.cat([q, k, v], dim=2)
        return packed[:, :, :h], packed[:, :, h : h + hkv], packed[:, :, h + hkv :]

    def heads_first():  # [B, H, S, D] tensors transposed to [B, S, H, D]
        return tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))

    return {
        "transposed-last-dim": tuple(transposed(x) for x in (q, k, v)),
        "sliced-last-dim": tuple(every_other(x) for x in (q, k, v)),
        "fused-qkv": fused_qkv(),
        "heads-first": heads_first(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_kernels_exact_on_strided_inputs(backend, dtype):
    q, k, v, dout = random_qkv(2, 16, 4, 2, 8, seed=5, dtype=dtype)
    kernel, scale = get_kernel(backend), 0.3
    base_out, base_lse = kernel.forward(q, k, v, causal=True, softmax_scale=scale)
    for name, (qs, ks, vs) in _strided_views(q, k, v).items():
        assert torch.equal(qs, q) and torch.equal(ks, k)
        out, lse = kernel.forward(qs, ks, vs, causal=True, softmax_scale=scale)
        grads = kernel.backward(dout.transpose(-1, -2).contiguous().transpose(-1, -2), qs, ks, vs,
                                out.transpose(-1, -2).contiguous().transpose(-1, -2), lse,
                                causal=True, softmax_scale=scale)
        assert torch.isfinite(out).all(), name
        assert torch.allclose(out.double(), base_out.double(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6), name
        assert torch.allclose(lse.double(), base_lse.double(), atol=1e-5), name
        if dtype != torch.bfloat16:
            ref = reference_with_grads(q, k, v, dout, causal=True, softmax_scale=scale)
            for actual, truth in zip((out, *grads), ref):
                assert rel_err(actual, truth) < 1e-5, name


def _strided_hybrid_case(rank, world, ulysses, ring, dtype):
    mesh = init_mesh(ulysses, ring)
    full = random_qkv(2, 8 * world, 4, 2, 16, seed=6, dtype=dtype)
    local = [hybridsp.shard_sequence(t, mesh) for t in full]
    expected = [hybridsp.shard_sequence(t, mesh) for t in reference_with_grads(*full, causal=True)]
    errors = {}
    for name, views in _strided_views(*local[:3]).items():
        q, k, v = (t.detach().requires_grad_() for t in views)
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True, backend="torch")
        out.backward(local[3])
        errors[name] = max(rel_err(a, e) for a, e in zip((out, q.grad, k.grad, v.grad), expected))
    return errors


@pytest.mark.parametrize("world,ulysses,ring", [(2, 1, 2), (2, 2, 1), (4, 2, 2)])
def test_hybrid_exact_on_strided_inputs(world, ulysses, ring):
    for errors in run_distributed(_strided_hybrid_case, world, ulysses, ring, torch.float32):
        assert max(errors.values()) < 1e-5, errors


def _strided_bf16_ring(rank, world):
    """bf16 pure ring (U = 1) on transposed inputs equals the same ring on contiguous inputs."""
    mesh = init_mesh(1, world)
    full = random_qkv(1, 16 * world, 4, 1, 16, seed=8, dtype=torch.bfloat16)
    local = [hybridsp.shard_sequence(t, mesh) for t in full]
    outs = []
    for q, k, v in (local[:3], _strided_views(*local[:3])["transposed-last-dim"]):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=True)
        out.backward(local[3])
        outs.append([out, q.grad, k.grad, v.grad])
    return all(torch.equal(a, b) for a, b in zip(*outs)) and all(torch.isfinite(t).all() for t in outs[1])


def test_bf16_ring_on_strided_inputs_is_bitwise_the_contiguous_result():
    assert all(run_distributed(_strided_bf16_ring, 2))


# --------------------------------------------------------------------------- float64: gradcheck


class _SumGradsOverRanks(torch.autograd.Function):
    """Identity whose backward sums the gradient over the world (test-only: replicated input)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class _GatherShards(torch.autograd.Function):
    """All context ranks' shards -> the full tensor; backward keeps this rank's rows (test-only,
    valid because every rank receives the same upstream gradient, as in gradcheck)."""

    @staticmethod
    def forward(ctx, local, mesh):
        ctx.mesh = mesh
        return hybridsp.gather_sequence(local, mesh)

    @staticmethod
    def backward(ctx, grad):
        return hybridsp.shard_sequence(grad, ctx.mesh), None


def _gradcheck_case(rank, world, ulysses, ring, layout, causal, kv_heads, masks=None):
    mesh = init_mesh(ulysses, ring, layout=layout)
    gen = torch.Generator().manual_seed(3)
    seq = 4 * world
    q = torch.randn(1, seq, 2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, seq, kv_heads, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, seq, kv_heads, 4, dtype=torch.float64, generator=gen, requires_grad=True)

    def full_attention(q, k, v):
        q, k, v = (hybridsp.shard_sequence(_SumGradsOverRanks.apply(t), mesh) for t in (q, k, v))
        out = hybrid_attn_func(q, k, v, mesh=mesh, causal=causal, softmax_scale=0.7, **(masks or {}))
        return _GatherShards.apply(out, mesh)

    return torch.autograd.gradcheck(full_attention, (q, k, v), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("world,ulysses,ring,layout,causal,kv_heads", [
    (2, 1, 2, "zigzag", True, 1),
    (2, 1, 2, "contiguous", False, 2),
    (4, 2, 2, "zigzag", True, 1),
])
def test_gradcheck_float64_through_ring_and_hybrid(world, ulysses, ring, layout, causal, kv_heads):
    assert all(run_distributed(_gradcheck_case, world, ulysses, ring, layout, causal, kv_heads, timeout=240))


def test_gradcheck_float64_with_packed_documents_and_a_window():
    masks = {"cu_seqlens": torch.tensor([0, 3, 4, 16]), "sliding_window": 5}
    assert all(run_distributed(_gradcheck_case, 4, 2, 2, "zigzag", True, 1, masks, timeout=240))


def test_gradcheck_float64_single_process_ring_of_one():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 6, 2, 3, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: ring_attention(q, k, v, None, causal=True), (q, k, v))


# --------------------------------------------------------------------------- refused before any collective


def _bad_inputs(mesh):
    """(description, call) pairs that must raise ValueError before any communication."""
    q, k, v, _ = random_qkv(1, 8, 4, 2, 8)
    call = lambda *args, **kw: hybrid_attn_func(*args, mesh=mesh, causal=True, **kw)  # noqa: E731
    return [
        ("unknown backend", lambda: call(q, k, v, backend="cudnn")),
        ("integer q", lambda: call(q.long(), k, v)),
        ("mixed dtypes", lambda: call(q, k.bfloat16(), v)),
        ("q/k batch mismatch", lambda: call(q, torch.cat([k, k]), torch.cat([v, v]))),
        ("different devices", lambda: call(q, k.to("meta"), v)),
        ("heads not divisible by U", lambda: call(q[:, :, :3], k[:, :, :1], v[:, :, :1])),
        ("sequence not splittable", lambda: call(q[:, :7], k[:, :7], v[:, :7])),
        ("k/v shapes differ", lambda: call(q, k, v[:, :, :1])),
        ("negative softmax scale", lambda: call(q, k, v, softmax_scale=-1.0)),
        ("flash on CPU", lambda: call(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend=_CpuFlashStandIn())),
    ]


_BAD_INPUT_NAMES = ("unknown backend", "integer q", "mixed dtypes", "q/k batch mismatch", "different devices",
                    "heads not divisible by U", "sequence not splittable", "k/v shapes differ",
                    "negative softmax scale", "flash on CPU")


class _CpuFlashStandIn:
    """A kernel object that, like flash-attn, refuses CPU tensors in check_inputs."""

    name = "cpu-refusing"

    def check_inputs(self, q):
        raise ValueError(f"this kernel runs on CUDA only; got {q.device}")


def _no_collective_allowed(*args, **kwargs):
    raise AssertionError("a collective was called before the input was validated")


def _refusals(rank, world, ulysses, ring):
    mesh = init_mesh(ulysses, ring)
    for name in ("all_to_all_single", "all_to_all", "batch_isend_irecv", "isend", "irecv", "all_reduce",
                 "all_gather", "broadcast"):
        setattr(dist, name, _no_collective_allowed)
    valid_here = {(1, 2): "heads not divisible by U", (2, 1): "sequence not splittable"}[(ulysses, ring)]
    messages = {}
    for description, call in _bad_inputs(mesh):
        if description == valid_here:  # 3 heads are fine without Ulysses; any length splits over a ring of one
            continue
        try:
            call()
        except ValueError as error:
            messages[description] = str(error)
        else:
            messages[description] = None
    return messages


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2)])
def test_bad_inputs_are_value_errors_before_any_collective(ulysses, ring):
    results = run_distributed(_refusals, 2, ulysses, ring)
    for messages in results:
        assert len(messages) == len(_BAD_INPUT_NAMES) - 1
        for description, message in messages.items():
            assert message, f"{description}: no ValueError"
    first = results[0]
    assert "cudnn" in first["unknown backend"] and "torch.int64" in first["integer q"]
    assert "torch.bfloat16" in first["mixed dtypes"] and "meta" in first["different devices"]


def test_unknown_backend_and_dtype_refused_by_ring_of_one():
    q, k, v, _ = random_qkv(1, 8, 2, 2, 8)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        ring_attention(q, k, v, None, backend="nope")
    with pytest.raises(ValueError, match="torch.int32"):
        ring_attention(q.int(), k, v, None)


# --------------------------------------------------------------------------- mesh.comm_counter


def _counted(rank, world):
    mesh = init_mesh(2, 2)
    q, k, v, _ = (hybridsp.shard_sequence(t, mesh) for t in random_qkv(1, 32, 4, 2, 8))
    explicit = CommCounter()
    hybrid_attn_func(q, k, v, mesh=mesh, causal=True, counter=explicit)
    mesh.comm_counter = CommCounter()
    hybrid_attn_func(q, k, v, mesh=mesh, causal=True)
    return dict(explicit.bytes_sent), dict(mesh.comm_counter.bytes_sent)


def test_mesh_comm_counter_records_calls_without_a_counter():
    for explicit, through_mesh in run_distributed(_counted, 4):
        assert explicit == through_mesh and explicit["all_to_all"] > 0 and explicit["ring"] > 0


# --------------------------------------------------------------------------- kernel choice (no GPU needed)


@pytest.mark.parametrize("device,dtype,head_dim,installed,expected", [
    ("cpu", torch.float32, 64, True, "torch"),
    ("cpu", torch.float64, 64, False, "torch"),
    ("cpu", torch.bfloat16, 80, True, "torch"),
    ("cuda", torch.bfloat16, 128, True, "flash"),
    ("cuda", torch.float16, 80, True, "flash"),
    ("cuda", torch.bfloat16, 128, False, "torch"),
    ("cuda", torch.float32, 128, True, "torch"),
    ("cuda", torch.bfloat16, 512, True, "torch"),
    ("cuda", torch.float64, 64, True, "reference"),
])
def test_auto_backend_choice(device, dtype, head_dim, installed, expected):
    assert choose_backend(device, dtype, head_dim, flash_installed=installed) == expected


@pytest.mark.parametrize("dtype,head_dim,expected", [
    (torch.bfloat16, 128, "flash"), (torch.float16, 256, "flash"), (torch.bfloat16, 250, "flash"),
    (torch.bfloat16, 512, "efficient"), (torch.float32, 64, "efficient"), (torch.float32, 80, "efficient"),
])
def test_cuda_variant_by_dtype_and_head_dim(dtype, head_dim, expected):
    assert cuda_variant(dtype, head_dim) == expected


def test_cuda_float64_is_refused_with_advice():
    with pytest.raises(ValueError, match="backend='reference'"):
        cuda_variant(torch.float64, 64)


@pytest.mark.parametrize("dtype,head_dim,kv_heads", [
    (torch.bfloat16, 80, 2), (torch.float32, 80, 1), (torch.bfloat16, 512, 4), (torch.float16, 64, 4),
])
def test_cuda_calls_have_the_right_shapes_on_the_meta_device(dtype, head_dim, kv_heads):
    """The aten CUDA calls (flash and memory-efficient, padded head dims, padded LSE) checked
    for argument order and shapes through their meta kernels; values need a GPU."""
    q = torch.empty(2, 30, 4, head_dim, device="meta", dtype=dtype)
    k = torch.empty(2, 30, kv_heads, head_dim, device="meta", dtype=dtype)
    out, lse = cuda_forward(q, k, k, True, 1 / math.sqrt(head_dim))
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, 30) and lse.dtype == torch.float32
    dq, dk, dv = cuda_backward(out, q, k, k, out, lse, True, 0.1)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape and dk.dtype == dtype


# --------------------------------------------------------------------------- same batch, bad labels


def test_fingerprint_sees_a_swap_of_two_tokens_1009_apart():
    from hybridsp.batch import batch_fingerprint

    ids = torch.randint(0, 50000, (1, 4096), generator=torch.Generator().manual_seed(0))
    swapped = ids.clone()
    swapped[0, 10], swapped[0, 1019] = ids[0, 1019], ids[0, 10]
    assert not torch.equal(ids, swapped)
    assert not torch.equal(batch_fingerprint(ids), batch_fingerprint(swapped))
    assert torch.equal(batch_fingerprint(ids), batch_fingerprint(ids.clone()))


def _swapped_batches(rank, world):
    from hybridsp.batch import check_same_across_context

    mesh = init_mesh(1, world)
    ids = torch.randint(0, 50000, (2, 2048), generator=torch.Generator().manual_seed(1))
    if rank == 1:
        ids[1, 5], ids[1, 1014] = ids[1, 1014].item(), ids[1, 5].item()
    try:
        check_same_across_context(ids, mesh)
    except ValueError as error:
        return str(error)
    return None


def test_context_ranks_with_swapped_tokens_all_raise():
    messages = run_distributed(_swapped_batches, 2)
    assert all(m and "loaded different batches" in m for m in messages)


def _bad_label_on_one_rank(rank, world, fused):
    mesh = init_mesh(1, world)
    hidden, weight = torch.randn(1, 8, 4, requires_grad=True), torch.randn(11, 4, requires_grad=True)
    labels = torch.randint(0, 11, (1, 8))
    if rank == world - 1:
        labels[0, 3] = 11  # outside [0, V)
    try:
        if fused:
            hybridsp.fused_cross_entropy(hidden, weight, labels, mesh)
        else:
            hybridsp.sharded_cross_entropy(hidden @ weight.T, labels, mesh)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("fused", [False, True])
def test_out_of_range_label_on_one_rank_raises_on_every_rank(fused):
    messages = run_distributed(_bad_label_on_one_rank, 2, fused)
    assert all(m and "outside the vocabulary [0, 11)" in m for m in messages), messages
