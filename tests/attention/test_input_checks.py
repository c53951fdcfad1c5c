"""Bad input to the attention is a ValueError before any collective (a collective called first fails the test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybridsp import HybridAttention, hybrid_attn_func, init_mesh, ring_attention, shard_sequence
from hybridsp.layout._documents import normalize_cu_seqlens
from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
from tests.helpers.references.attention import random_qkv


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


_BAD_INPUT_NAMES = (
    "unknown backend",
    "integer q",
    "mixed dtypes",
    "q/k batch mismatch",
    "different devices",
    "heads not divisible by U",
    "sequence not splittable",
    "k/v shapes differ",
    "negative softmax scale",
    "flash on CPU",
)


class _CpuFlashStandIn:
    """A kernel object that, like flash-attn, refuses CPU tensors in check_inputs."""

    name = "cpu-refusing"

    def check_inputs(self, q):
        raise ValueError(f"this kernel runs on CUDA only; got {q.device}")


def _no_collective_allowed(*args, **kwargs):
    raise AssertionError("a collective was called before the input was validated")


def _refusals(rank, world, ulysses, ring):
    mesh = init_mesh(ulysses, ring)
    for name in (
        "all_to_all_single",
        "all_to_all",
        "batch_isend_irecv",
        "isend",
        "irecv",
        "all_reduce",
        "all_gather",
        "broadcast",
    ):
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


@pytest.mark.distributed
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


# --------------------------------------------------------------------------- ranks that disagree; bad types


def _disagree(rank, world, what):
    mesh = init_mesh(ulysses=2, ring=world // 2)
    q, k, v, _ = random_qkv(1, 64, 4, 2, 8, seed=3)
    local = [shard_sequence(t, mesh) for t in (q, k, v)]
    kwargs = {"mesh": mesh, "backend": "torch"}
    if what == "window":
        kwargs["sliding_window"] = 8 if rank == world - 1 else 16
    elif what == "documents":
        kwargs["cu_seqlens"] = torch.tensor([0, 30, 64] if rank == 1 else [0, 20, 64])
    elif what == "length":
        local = [t[:, :8] if rank == 2 else t for t in local]
    try:
        hybrid_attn_func(*local, **kwargs)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("what", ["window", "documents", "length"])
def test_ranks_that_disagree_raise_on_every_rank(what):
    messages = run_distributed(_disagree, 4, what, timeout=300)  # catches a hang
    assert all(m is not None and "disagree" in m for m in messages), messages


def _placement_window_disagrees(rank, world):
    """Balanced meshes built with different placement windows, called with raw boundaries (so the
    window comes from each rank's mesh, not from a shared Documents)."""
    mesh = init_mesh(ulysses=2, ring=world // 2, layout="balanced", sliding_window=8 if rank == world - 1 else None)
    q, k, v, _ = random_qkv(1, 64, 4, 2, 8, seed=3)
    bounds = torch.tensor([0, 20, 64])
    local = [shard_sequence(t, mesh, cu_seqlens=bounds) for t in (q, k, v)]
    try:
        hybrid_attn_func(*local, mesh=mesh, backend="torch", cu_seqlens=bounds)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_meshes_placing_for_different_windows_raise_on_every_rank():
    messages = run_distributed(_placement_window_disagrees, 4, timeout=120)  # catches a hang
    assert all(m is not None and "disagree on placement window" in m for m in messages), messages


def _later_call_disagrees(rank, world, scenario):
    """Calls that share one Documents object: the first ones agree; the last has a window on the last rank only."""
    from hybridsp.layout._documents import as_documents

    mesh = init_mesh(ulysses=2, ring=world // 2)
    q, k, v, _ = random_qkv(1, 64, 4, 2, 8, seed=3)
    local = [shard_sequence(t, mesh) for t in (q, k, v)]
    documents = as_documents(torch.tensor([0, 20, 64]), 1, 64)  # what shard_batch hands every layer
    call = lambda window: hybrid_attn_func(  # noqa: E731
        *local, mesh=mesh, backend="torch", cu_seqlens=documents, sliding_window=window
    )
    agreed = [None, 8] if scenario == "both settings agreed before" else [None]
    for window in agreed:
        call(window)
    try:
        call(8 if rank == world - 1 else None)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", ["first call agreed", "both settings agreed before"])
def test_a_later_call_that_disagrees_on_the_same_documents_raises_on_every_rank(scenario):
    messages = run_distributed(_later_call_disagrees, 4, scenario, timeout=60)  # a hang fails within a minute
    assert all(m is not None and "disagree on sliding_window" in m for m in messages), messages


def test_cu_seqlens_refuses_floats_and_accepts_numpy():
    with pytest.raises(ValueError, match="integer"):
        normalize_cu_seqlens([0, 5.7, 16], 1, 16)
    with pytest.raises(ValueError, match="integer"):
        normalize_cu_seqlens(torch.tensor([0.0, 16.0]), 1, 16)
    rows = np.array([[0, 5, 16], [0, 9, 16]])
    assert normalize_cu_seqlens(rows, 2, 16) == ((0, 5, 16), (0, 9, 16))
    assert normalize_cu_seqlens(np.array([0, 5, 16], dtype=np.int32), 2, 16) == ((0, 5, 16), (0, 5, 16))


def test_causal_must_be_a_bool():
    mesh = mesh_at(1, 1)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="causal must be True or False"):
        hybrid_attn_func(q, q, q, mesh=mesh, causal="no")
    with pytest.raises(ValueError, match="causal must be True or False"):
        HybridAttention(mesh, causal=1)
