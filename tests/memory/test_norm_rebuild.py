"""NormInputKept: projections keep the norm's input and rebuild its output in their backward.

A pre-norm block ``x + sum_i(proj_i(norm(x)) * attn)`` (three projections; ``attn`` a stand-in attention whose
backward runs before the projections', as the attention's does in the half) is differentiated with and without
the hooks: the output and every gradient bitwise equal, with HF's RMSNorm and the lean norm, fp32/fp64/bf16,
B = 2 (3-D input: ``F.linear`` keeps a [T, h] view), the projections' input handed on as DeepSpeed ZeRO-3
hands it (``input.detach()`` through an autograd function), without checkpointing, under non-reentrant and
reentrant checkpointing, under CPU autocast (bf16 weights), and two backwards through a retained graph.
While the stand-in attention's backward runs, no norm output is alive (with the hooks), where one is without
them; the three projections share one rebuild per backward. Kept as is, not rebuilt: a norm output changed
by a forward hook (a new tensor, or in place), under a global module hook, not contiguous, or modified in
place before it is saved. The transformers path (split checkpointing) is
tests/memory/test_split_checkpoint.py's bitwise comparison, and DeepSpeed ZeRO-3 tests/memory/test_zero3.py's.
"""

from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hybridsp
from hybridsp.memory._norm_rebuild import NormInputKept, _SharedRebuild

HIDDEN = 12


class _DetachAlias(torch.autograd.Function):
    """What DeepSpeed ZeRO-3's module hooks hand a module: ``input.detach()``, gradients passed through."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Probe(torch.autograd.Function):
    """Identity that keeps its input, as an attention keeps q, k, v (its backward's unpack starts a
    checkpoint's recompute), and whose backward calls ``at_backward`` (the attention's backward moment)."""

    @staticmethod
    def forward(ctx, x, at_backward):
        ctx.save_for_backward(x)
        ctx.at_backward = at_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (_kept,) = ctx.saved_tensors  # the unpack a checkpoint recomputes on
        ctx.at_backward()
        return grad, None


class _Block(nn.Module):
    def __init__(self, dtype: torch.dtype, lean: bool, alias: bool) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        torch.manual_seed(0)
        self.input_layernorm = LlamaRMSNorm(HIDDEN, eps=1e-6).to(dtype)
        with torch.no_grad():
            self.input_layernorm.weight.uniform_(0.5, 1.5)
        self.projections = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=i == 1, dtype=dtype) for i in range(3))
        self.alias = alias
        self.outputs: list[torch.UntypedStorage] = []  # the storage of every norm output made
        self.alive_at_attention: list[int] = []
        self.input_layernorm.register_forward_hook(lambda m, i, out: self.outputs.append(out.untyped_storage()))
        if lean:
            hybridsp.apply_lean_norms(self, tile_tokens=5)

    def half(self, x: torch.Tensor, kept: bool) -> torch.Tensor:
        """x + (q * k + v) with q, k, v the projections of norm(x) (the stand-in attention probed)."""
        if kept:
            with NormInputKept(self.input_layernorm, x) as scope:
                mixed = self._attend(scope.normalized())
        else:
            mixed = self._attend(self.input_layernorm(x))
        return x + mixed

    def _attend(self, normed: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(_DetachAlias.apply(normed) if self.alias else normed) for p in self.projections)
        return _Probe.apply(q * k + v, self._count_alive)

    def _count_alive(self) -> None:
        """How many norm outputs' storages a tensor (any alias: checkpoints keep detached ones) still holds."""
        self.alive_at_attention.append(sum(torch._C._storage_Use_Count(s._cdata) > 1 for s in self.outputs))


def _run(block: _Block, x: torch.Tensor, kept: bool, mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.detach().requires_grad_()
    fn = partial(block.half, kept=kept)
    out = fn(x) if mode == "none" else checkpoint(fn, x, use_reentrant=mode == "reentrant")
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return out.detach(), grads


def _input(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(2, 7, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)


def _assert_bitwise(got, want) -> None:
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def rebuilds(monkeypatch) -> list[int]:
    """One entry per rebuild of a norm's output."""
    made: list[int] = []
    original = _SharedRebuild._rebuild
    monkeypatch.setattr(_SharedRebuild, "_rebuild", lambda self, x: made.append(1) or original(self, x))
    return made


@pytest.mark.parametrize("mode", ["none", "non-reentrant", "reentrant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("lean", [False, True], ids=["hf-norm", "lean-norm"])
@pytest.mark.parametrize("alias", [False, True], ids=["direct", "zero3-alias"])
def test_kept_input_is_bitwise_and_frees_the_norm_output(mode, dtype, lean, alias):
    want_block, got_block = _Block(dtype, lean, alias), _Block(dtype, lean, alias)
    want = _run(want_block, _input(dtype), kept=False, mode=mode)
    got = _run(got_block, _input(dtype), kept=True, mode=mode)
    _assert_bitwise(got, want)
    assert want_block.alive_at_attention == [1]  # the projections hold the norm's output
    assert got_block.alive_at_attention == [0]  # nothing holds it: rebuilt after


def test_three_projections_share_one_rebuild(rebuilds):
    for mode in ("none", "non-reentrant"):
        rebuilds.clear()
        _run(_Block(torch.float32, lean=True, alias=True), _input(torch.float32), kept=True, mode=mode)
        assert rebuilds == [1]


def test_under_autocast_the_rebuild_equals_the_forward(rebuilds):
    """bf16 weights under CPU autocast: the projections keep the norm's bf16 output itself, rebuilt under
    the forward's autocast state (with fp32 weights they keep their own casts: nothing to rebuild)."""
    runs = []
    for kept in (False, True):
        block = _Block(torch.bfloat16, lean=False, alias=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs.append(_run(block, _input(torch.bfloat16), kept=kept, mode="non-reentrant"))
    _assert_bitwise(runs[1], runs[0])
    assert rebuilds == [1]


def test_retained_graph_backward_twice_rebuilds_once_each(rebuilds):
    outs = []
    for kept in (False, True):
        block = _Block(torch.float64, lean=True, alias=True)
        x = _input(torch.float64).requires_grad_()
        out = block.half(x, kept=kept)
        grads = [torch.autograd.grad(out.sum(), [x, *block.parameters()], retain_graph=True) for _ in range(2)]
        outs.append(grads)
    for got, want in zip(outs[1], outs[0], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert rebuilds == [1, 1]


@pytest.mark.parametrize("hook", ["new tensor", "in place", "global"])
def test_a_hooked_norm_output_is_kept_not_rebuilt(hook, rebuilds):
    """A forward hook that returns another tensor or writes into the output (or any global module hook):
    the rebuild would not be what the projections saw, so they keep the output as before."""

    def scaled(module, args, out):
        return out * 0.5 if hook != "in place" else out.mul_(0.5)

    runs = []
    for kept in (False, True):
        block = _Block(torch.float64, lean=False, alias=False)
        if hook == "global":
            handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
        else:
            handle = block.input_layernorm.register_forward_hook(scaled)
        try:
            runs.append(_run(block, _input(torch.float64), kept=kept, mode="non-reentrant"))
        finally:
            handle.remove()
    _assert_bitwise(runs[1], runs[0])
    assert rebuilds == []


def test_a_non_contiguous_norm_output_is_kept_not_rebuilt(rebuilds):
    class TransposedNorm(nn.Module):  # returns a non-contiguous view of a fresh tensor
        def forward(self, x):
            return (x * 2.0).transpose(0, 1).contiguous().transpose(0, 1)

    x = _input(torch.float64).requires_grad_()
    linear = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
    with NormInputKept(TransposedNorm(), x) as scope:
        normed = scope.normalized()
        out = linear(normed)
    assert not normed.is_contiguous()
    out.sum().backward()
    torch.testing.assert_close(linear.weight.grad, (2.0 * x).detach().sum((0, 1)).expand(HIDDEN, -1))
    assert rebuilds == []


def test_a_norm_output_changed_in_place_before_it_is_saved_is_kept_as_is():
    block = _Block(torch.float64, lean=False, alias=False)
    x = _input(torch.float64).requires_grad_()
    with NormInputKept(block.input_layernorm, x) as scope:
        normed = scope.normalized()
        normed.mul_(2.0)  # a later in-place change: the saved rows are not the norm's
        out = block.projections[0](normed)
    out.sum().backward()
    assert block.alive_at_attention == []
    want = (2.0 * block.input_layernorm(x)).detach().sum((0, 1)).expand(HIDDEN, -1)  # not the norm's rows
    torch.testing.assert_close(block.projections[0].weight.grad, want, rtol=1e-12, atol=1e-12)


def test_without_gradients_nothing_is_hooked():
    block = _Block(torch.float32, lean=True, alias=False)
    with torch.no_grad(), NormInputKept(block.input_layernorm, _input(torch.float32)) as scope:
        assert torch.equal(scope.normalized(), block.input_layernorm(_input(torch.float32)))
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
