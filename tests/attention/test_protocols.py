"""The declared protocols: kernels and transports offer every member the call uses (no discovery),
a user's forward/backward-only kernel is completed in one place, the balanced tries are strategy
objects, the agreement fingerprint names its fields, and helpers have one home."""

from __future__ import annotations

import ast

import pytest
import torch

from hybridsp import ring_attention
from hybridsp._formulas import zigzag_slot_runs
from hybridsp.attention import CallSpec
from hybridsp.attention import _resolve as resolve
from hybridsp.attention._transport import exchange
from hybridsp.attention._transport.allgather import AllGatherTransport
from hybridsp.attention._transport.base import Block, Transport
from hybridsp.attention._transport.local import LocalTransport
from hybridsp.attention._transport.p2p import P2PTransport
from hybridsp.kernels import (
    AttentionKernel,
    ReferenceKernel,
    TorchFusedKernel,
    complete_kernel,
    get_kernel,
    resolve_kernel,
)
from hybridsp.kernels._flash import FlashAttnKernel
from hybridsp.kernels._select import CompletedKernel
from hybridsp.layout._balance.tries import TRIES, BalancerTry, GreedyTry, HostedTry
from hybridsp.layout._layouts import get_layout
from tests.helpers.flash_attn_standin import make_standin
from tests.helpers.paths import ROOT

PACKAGE = ROOT / "hybridsp"


class ForwardBackwardOnly:
    """A user's kernel object with only the plain calls (what ``get_kernel`` promises to accept)."""

    def __init__(self):
        self._inner = TorchFusedKernel()

    def forward(self, q, k, v, *, causal, softmax_scale):
        return self._inner.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, softmax_scale):
        return self._inner.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)


class ForwardBackwardSubclass(ForwardBackwardOnly, AttentionKernel):
    """A subclass of the protocol that defines only the plain calls: it inherits the declarations of
    the band calls, which do nothing, so it must still get the reference band math."""

    name = "forward-backward subclass"


@pytest.mark.parametrize("kernel", [ReferenceKernel(), TorchFusedKernel(), FlashAttnKernel(make_standin("2.8"))])
def test_every_backend_declares_the_protocol(kernel):
    assert AttentionKernel in type(kernel).__mro__
    assert complete_kernel(kernel) is kernel
    assert isinstance(kernel.supports_varlen, bool)
    q = torch.zeros(1, 4, 2, 8, dtype=torch.bfloat16)
    assert kernel.check_inputs(q) is None
    for member in ("forward", "backward", "forward_band", "backward_band", "forward_varlen", "backward_varlen"):
        assert callable(getattr(kernel, member))


def test_the_default_varlen_calls_refuse():
    with pytest.raises(NotImplementedError, match="supports_varlen is False"):
        TorchFusedKernel().forward_varlen(
            None,
            None,
            None,
            cu_seqlens_q=None,
            cu_seqlens_k=None,
            max_seqlen_q=0,
            max_seqlen_k=0,
            window=(-1, -1),
            softmax_scale=1.0,
        )


def test_a_forward_backward_object_is_completed_with_the_documented_defaults():
    user = ForwardBackwardOnly()
    assert get_kernel(user) is user  # get_kernel returns objects unchanged
    kernel = complete_kernel(user)
    assert isinstance(kernel, CompletedKernel) and kernel.inner is user
    assert kernel.supports_varlen is False and kernel.name == "ForwardBackwardOnly"
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    assert kernel.check_inputs(q) is None
    band = (0, 2)
    out, lse = kernel.forward_band(q, k, v, band=band, softmax_scale=0.3)
    ref_out, ref_lse = ReferenceKernel().forward_band(q, k, v, band=band, softmax_scale=0.3)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_a_forward_backward_object_runs_band_pieces_by_the_reference_math():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    outs, grads = [], []
    for backend in (ForwardBackwardOnly(), ForwardBackwardSubclass(), "reference"):
        out = ring_attention(q, k, v, None, causal=True, sliding_window=5, backend=backend)
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for out, grad in zip(outs[:-1], grads[:-1]):
        torch.testing.assert_close(out, outs[-1], rtol=1e-10, atol=1e-10)
        for a, b in zip(grad, grads[-1]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_partial_object_still_raises_its_own_check_first():
    class Refusing:
        def check_inputs(self, q):
            raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        resolve_kernel(Refusing(), torch.zeros(1, 4, 2, 8))


def test_transports_declare_one_protocol_and_blocks_name_their_home():
    for transport in (LocalTransport, P2PTransport, AllGatherTransport):
        assert Transport in transport.__mro__
    block = Block((), None, None, step=3)
    assert block.step == 3 and block.chunk_rows is None and not hasattr(block, "tag")


def test_point_to_point_tags_are_distinct_and_in_one_module():
    tags = [exchange.KV_TAG, exchange.GRAD_TAG, exchange.ALLGATHER_TAG]
    assert len(set(tags)) == len(tags)
    for path in (PACKAGE / "attention").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and path.name != "exchange.py":
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                assert not any(name.endswith("_TAG") for name in names), (path, names)


def test_no_discovery_in_the_call_path():
    for name in (
        "attention/_pieces.py",
        "attention/_varlen.py",
        "attention/_resolve.py",
        "attention/_ring_function.py",
    ):
        source = (PACKAGE / name).read_text()
        assert "hasattr(" not in source and "getattr(" not in source, name


def test_the_fingerprint_names_its_fields():
    fields = resolve.CallFingerprint._fields
    assert fields[:4] == ("batch", "local_tokens", "query_heads", "head_dim")
    assert len(resolve._NAMES) == len(fields) + 2 and resolve._NAMES[-2:] == ("documents", "documents")
    k = torch.zeros(2, 8, 2, 16)
    zigzag = get_layout("zigzag")
    fingerprint = resolve.CallFingerprint.of(torch.zeros(2, 8, 4, 16), k, k[..., :12], CallSpec(), zigzag, None)
    assert fingerprint.batch == 2 and fingerprint.kv_heads == 2 and fingerprint.sliding_window == -1
    assert tuple(fingerprint) == (2, 8, 4, 16, 2, 12, 2, 1, -1, 0, 0, -1, 0, 0, 0, 0, 1)
    capped = resolve.CallFingerprint.of(
        torch.zeros(2, 8, 4, 16), k, k, CallSpec(softcap=50.0), zigzag, None, torch.zeros(4, dtype=torch.bfloat16)
    )
    assert capped.sinks == 2 and capped.softcap > 0 and capped.v_head_dim == 16


def test_tries_are_strategy_objects():
    assert all(isinstance(t, (BalancerTry, GreedyTry, HostedTry)) for t in TRIES)
    assert len(set(TRIES)) == len(TRIES)
    assert HostedTry(0.0, 0.5).duplicate_key(2) == HostedTry(0.5, 0.5).duplicate_key(2)  # one host either way


@pytest.mark.parametrize("ring", [1, 2, 4])
def test_zigzag_runs_have_one_definition(ring):
    assert get_layout("zigzag").slot_runs(16 * ring, ring) == zigzag_slot_runs(16 * ring, ring)
    assert get_layout("balanced").slot_runs(16 * ring, ring, (0, 16 * ring)) == zigzag_slot_runs(16 * ring, ring)
