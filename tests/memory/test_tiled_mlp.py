"""apply_tiled_mlp against the unmodified Hugging Face model: loss and every gradient, memory kept.

(Under ZeRO-3 with sequence parallelism: tests/memory/test_zero3.py.)
"""

import pytest
import torch
from torch import nn

from hybridsp.memory._tiled_mlp import apply_tiled_mlp, tiled_mlp_forward
from tests.helpers.models.tiny import tiny_causal_lm
from tests.helpers.references.attention import rel_err

VOCAB, SEQ = 64, 50


def _model(bias=False, dtype=torch.float32):
    return tiny_causal_lm(
        "llama",
        seed=0,
        dtype=dtype,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        mlp_bias=bias,
        attn_implementation="sdpa",
    )


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return [out.loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _ids(seed=0):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "bias,checkpointing,tile",
    [
        pytest.param(False, False, 7, marks=pytest.mark.slow),  # the same tiles as (False, True, 7), recomputed
        (True, False, 50),
        (False, True, 7),
        pytest.param(True, True, 1000, marks=pytest.mark.slow),  # one tile; bias and checkpointing: the two above
    ],
)  # tiles: non-divisor, 2, 1
def test_tiled_gradients_equal_untiled(bias, checkpointing, tile):
    model, ids = _model(bias), _ids()
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    expected = _loss_and_grads(model, ids)
    with apply_tiled_mlp(model, tile_tokens=tile) as handle:
        assert handle.tile_tokens == tile and len(handle.modules) == 2
        actual = _loss_and_grads(model, ids)
    errors = [rel_err(a, e) for a, e in zip(actual, expected)]
    assert max(errors) <= 1e-5, errors
    assert all("forward" not in vars(m) for m in handle.modules)  # undone
    assert max(rel_err(a, e) for a, e in zip(_loss_and_grads(model, ids), expected)) == 0.0


def test_bf16_within_twice_the_untiled_error():
    ids = _ids(1)
    exact = _loss_and_grads(_model(dtype=torch.float64), ids)
    model = _model(dtype=torch.bfloat16)
    untiled = [rel_err(a, e) for a, e in zip(_loss_and_grads(model, ids), exact)]
    apply_tiled_mlp(model, tile_tokens=9)
    tiled = [rel_err(a, e) for a, e in zip(_loss_and_grads(model, ids), exact)]
    assert all(t <= 2 * u + 1e-3 for t, u in zip(tiled, untiled)), (tiled, untiled)


def test_only_the_input_is_kept_for_backward():
    """Saved for backward inside one MLP: untiled keeps [T, I]-sized tensors; tiled only x [T, h]."""
    model = _model()
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, SEQ, 32, requires_grad=True) * 1.0  # not a leaf, like an activation

    def saved_bytes(fn):
        storages = {}

        def pack(tensor):
            if not isinstance(tensor, torch.nn.Parameter) and tensor.data_ptr() != 0:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x)
        return sum(storages.values())

    untiled = saved_bytes(mlp)
    tiled = saved_bytes(lambda t: tiled_mlp_forward(mlp, t, 8))
    assert tiled == x.numel() * 4, tiled
    assert untiled >= 3 * 2 * SEQ * 80 * 4, untiled  # gate, up, act(gate) outputs at least


def _norm_then_mlp(model, x, detach_source: bool):
    """post_attention_layernorm (lean) then the tiled MLP of layer 0 on x; (out, unique saved storage bytes).
    ``detach_source``: the MLP gets ``normed * 1`` (the same values, no norm source: it keeps its input)."""
    layer = model.model.layers[0]
    storages = {}

    def pack(tensor):
        if not isinstance(tensor, torch.nn.Parameter):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        normed = layer.post_attention_layernorm(x)
        out = layer.mlp(normed * 1 if detach_source else normed)
    return out, sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_after_a_lean_norm_the_mlp_keeps_the_norms_input_not_its_own(dtype):
    """Norm -> tiled MLP: the MLP keeps what the norm keeps (x, rstd) and rebuilds its input rows per tile:
    one [T, h] storage fewer, and the output and every gradient bit-identical to the MLP keeping its input."""
    from hybridsp.memory._lean_norm import apply_lean_norms

    model = _model(dtype=dtype)
    apply_lean_norms(model, tile_tokens=16)
    apply_tiled_mlp(model, tile_tokens=7)
    x = (torch.randn(2, SEQ, 32, dtype=dtype) * 3).requires_grad_()
    grad = torch.randn(2, SEQ, 32, dtype=dtype)
    results, kept = [], []
    for detach_source in (True, False):
        x.grad = None
        model.zero_grad(set_to_none=True)
        out, saved = _norm_then_mlp(model, x, detach_source)
        out.backward(grad)
        results.append(
            [out.detach(), x.grad] + [p.grad.clone() for p in model.model.layers[0].parameters() if p.grad is not None]
        )
        kept.append(saved)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert kept[0] - kept[1] == x.numel() * x.element_size(), kept  # the norm's output is no longer kept


def test_an_input_modified_after_its_norm_is_kept_as_it_is():
    """The norm's output changed in place before the MLP: the MLP keeps it (no rebuild from the norm)."""
    from hybridsp.memory._lean_norm import apply_lean_norms, norm_source

    model = _model()
    apply_lean_norms(model)
    apply_tiled_mlp(model, tile_tokens=7)
    layer = model.model.layers[0]
    x = torch.randn(2, SEQ, 32, requires_grad=True)
    normed = layer.post_attention_layernorm(x)
    assert norm_source(normed) is not None
    normed.mul_(2.0)
    assert norm_source(normed) is None
    expected = layer.mlp(normed.detach().clone().requires_grad_())
    assert torch.equal(layer.mlp(normed), expected)


def test_bad_arguments_raise_value_errors():
    model = _model()
    with pytest.raises(ValueError, match="tile_tokens must be a positive"):
        apply_tiled_mlp(model, tile_tokens=0)
    with pytest.raises(ValueError, match="no gated MLP"):
        apply_tiled_mlp(torch.nn.Linear(2, 2))
    handle = apply_tiled_mlp(model)
    assert handle.tile_tokens == 32  # the hidden size
    with pytest.raises(ValueError, match="already"):
        apply_tiled_mlp(model)
    handle.undo()
    handle.undo()  # idempotent


# --------------------------------------------------------------------------- some projections with a bias


class _GatedMLP(nn.Module):
    def __init__(self, biases: tuple[bool, bool, bool]):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 20, bias=biases[0]), nn.Linear(8, 20, bias=biases[1])
        self.down_proj, self.act_fn = nn.Linear(20, 8, bias=biases[2]), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("biases", [(False, False, True), (True, False, False), (True, True, False), (True,) * 3])
def test_tiled_mlp_keeps_every_bias_that_exists(biases):
    torch.manual_seed(0)
    mlp = _GatedMLP(biases)
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        if linear.bias is not None:
            nn.init.normal_(linear.bias)  # far from 0, so a dropped bias shows
    x = torch.randn(2, 11, 8, requires_grad=True)
    grad = torch.randn(2, 11, 8)
    expected = mlp(x)
    expected_grads = torch.autograd.grad(expected, [x, *mlp.parameters()], grad)
    with apply_tiled_mlp(mlp, tile_tokens=4):
        actual = mlp(x)
        actual_grads = torch.autograd.grad(actual, [x, *mlp.parameters()], grad)
    assert rel_err(actual, expected) < 1e-6
    assert max(rel_err(a, e) for a, e in zip(actual_grads, expected_grads)) < 1e-5
