"""Lean RoPE (``apply_lean_rope``; ``rotate_`` in hybridsp.memory._rotary) against Hugging Face's rotation.

Kernel: the in-place rotation equals HF's ``apply_rotary_pos_emb`` bitwise, values and input gradients,
in fp32/fp64/bf16/fp16, flat [B, S, H * D] and per-head [B, S, H, D] inputs, B = 2 with cos of batch 1
or B, tiles that do not divide S, one head, and a strided input (rotated into a new tensor); it rotates
a fresh tensor in place and never a view or a leaf. Models: Llama, Mistral (sliding window), Qwen2,
Qwen3 (q/k norms), Mixtral, in fp32 and fp64, eager and sdpa (B = 2, with left padding), with and without
checkpointing and under split checkpointing with lean norms: loss, logits and every gradient bitwise
those of the unmodified model. Undo, twice, families with another rotation (GLM-4) or forward raise.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridsp
from hybridsp.memory._rotary import rotate_
from tests.helpers.models.tiny import tiny_causal_lm

VOCAB, SEQ = 64, 20


def _tables(batch: int, seq: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotary cos, sin [batch, seq, dim] for positions 3.. (cat of the frequencies twice)."""
    positions = torch.arange(3, 3 + seq, dtype=torch.float32)[None].expand(batch, seq)  # [B, S]
    freqs = positions[..., None] / 500.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [B, S, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [B, S, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _hf(x_heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotated, _ = apply_rotary_pos_emb(x_heads.transpose(1, 2), x_heads.transpose(1, 2), cos, sin)
    return rotated.transpose(1, 2)  # [B, S, H, D]


KERNEL_CASES = [  # (dtype, batch, cos batch, heads, head dim, flat input, tile)
    (torch.float32, 2, 2, 3, 10, True, 8),
    (torch.float64, 2, 1, 1, 6, False, 7),
    (torch.bfloat16, 1, 1, 4, 16, True, 1024),
    (torch.float16, 2, 2, 2, 8, False, 5),
]


@pytest.mark.fast
@pytest.mark.parametrize(("dtype", "batch", "cos_batch", "heads", "dim", "flat", "tile"), KERNEL_CASES)
def test_rotation_is_hf_bitwise_and_in_place(dtype, batch, cos_batch, heads, dim, flat, tile):
    gen = torch.Generator().manual_seed(heads)
    base = torch.randn(batch, SEQ, heads, dim, generator=gen).to(dtype)
    grad = torch.randn(batch, SEQ, heads, dim, generator=gen).to(dtype)
    cos, sin = _tables(cos_batch, SEQ, dim, dtype)
    want_leaf = base.clone().requires_grad_()
    want = _hf(want_leaf * 1, cos, sin)
    want.backward(grad)
    got_leaf = base.clone().requires_grad_()
    fresh = got_leaf * 1  # a fresh non-leaf, as a projection's output
    fresh = fresh.reshape(batch, SEQ, heads * dim).clone() if flat else fresh
    got = rotate_(fresh, cos, sin, dim, tile)
    assert got.data_ptr() == fresh.data_ptr()  # rotated in place
    got.backward(grad.reshape(got.shape))
    assert torch.equal(got.reshape(want.shape), want.detach())
    assert torch.equal(got_leaf.grad, want_leaf.grad)


@pytest.mark.fast
def test_views_leaves_and_strided_inputs_are_rotated_into_new_tensors():
    gen = torch.Generator().manual_seed(0)
    cos, sin = _tables(2, SEQ, 8, torch.float32)
    strided = torch.randn(2, 3, SEQ, 8, generator=gen).transpose(1, 2)  # [B, S, H, D], heads-first storage
    want = _hf(strided, cos, sin)
    got = rotate_(strided, cos, sin, 8, 6)
    assert got.data_ptr() != strided.data_ptr() and torch.equal(got, want)
    view = strided.contiguous().view(2, SEQ, 24)  # [B, S, H * D] view: rotated into a new tensor
    assert rotate_(view, cos, sin, 8).data_ptr() != view.data_ptr()
    leaf = torch.randn(2, SEQ, 3, 8, generator=gen, requires_grad=True)
    rotated = rotate_(leaf, cos, sin, 8)
    assert rotated.data_ptr() != leaf.data_ptr() and torch.equal(rotated, _hf(leaf, cos, sin))
    mixed = torch.randn(2, SEQ, 3, 8, generator=gen).to(torch.bfloat16)  # fp32 tables promote: HF's dtype
    assert torch.equal(rotate_(mixed.clone(), cos, sin, 8), _hf(mixed, cos, sin))


@pytest.mark.fast
def test_bad_shapes_raise_value_errors():
    cos, sin = _tables(1, SEQ, 8, torch.float32)
    with pytest.raises(ValueError, match="even head dim"):
        rotate_(torch.zeros(1, SEQ, 14), cos[..., :7], sin[..., :7], 7)
    with pytest.raises(ValueError, match=r"not \[B, S, H \* 8\]"):
        rotate_(torch.zeros(1, SEQ, 12), cos, sin, 8)
    with pytest.raises(ValueError, match="cos .* does not fit"):
        rotate_(torch.zeros(1, SEQ + 1, 16), cos, sin, 8)


def _model(family: str, dtype: torch.dtype, attn: str, checkpointing: str) -> nn.Module:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    if family == "mistral":
        fields.update(sliding_window=6)
    if family == "mixtral":
        fields.update(num_local_experts=4, num_experts_per_tok=2)
    model = tiny_causal_lm(family, seed=0, dtype=dtype, **fields).train()
    if checkpointing != "none":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    return model


def _step(model: nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    if model.config._attn_implementation == "sdpa":  # eager attention's fully masked rows are NaN in HF itself
        mask[1, :4] = 0  # left padding on the second row
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=embeds, attention_mask=mask, labels=ids)
    out.loss.backward()
    return [out.loss.detach(), out.logits.detach(), embeds.grad] + [p.grad for p in model.parameters()]


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert (a is None) == (b is None), index
        assert a is None or torch.equal(a, b), (index, (a - b).abs().max())


MODEL_CASES = [  # (family, dtype, attention implementation, checkpointing)
    ("llama", torch.float32, "sdpa", "none"),
    ("llama", torch.float64, "eager", "non-reentrant"),
    ("mistral", torch.float32, "eager", "reentrant"),
    ("qwen2", torch.float64, "sdpa", "non-reentrant"),
    ("qwen3", torch.float32, "sdpa", "none"),
    ("qwen3", torch.float64, "eager", "reentrant"),
    ("mixtral", torch.float32, "sdpa", "non-reentrant"),
]


@pytest.mark.parametrize(("family", "dtype", "attn", "checkpointing"), MODEL_CASES)
def test_lean_rope_model_is_the_model_bitwise(family, dtype, attn, checkpointing):
    want = _step(_model(family, dtype, attn, checkpointing))
    model = _model(family, dtype, attn, checkpointing)
    handle = hybridsp.apply_lean_rope(model, tile_tokens=7)
    assert len(handle.modules) == 2
    _assert_bitwise(_step(model), want)


def test_composes_with_split_checkpointing_and_lean_norms_bitwise():
    def prepared(lean_rope: bool) -> nn.Module:
        model = _model("qwen3", torch.float32, "sdpa", "non-reentrant")
        hybridsp.apply_split_checkpointing(model)
        hybridsp.apply_lean_norms(model)
        if lean_rope:
            hybridsp.apply_lean_rope(model)
        return model

    _assert_bitwise(_step(prepared(True)), _step(prepared(False)))


def _one_layer(family: str) -> nn.Module:
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, head_dim=8)
    return tiny_causal_lm(family, seed=0, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **fields)


@pytest.mark.fast
def test_undo_twice_and_other_forms():
    model = _model("llama", torch.float32, "sdpa", "none")
    handle = hybridsp.apply_lean_rope(model)
    with pytest.raises(ValueError, match="switched twice"):
        hybridsp.apply_lean_rope(model)
    handle.undo()
    assert not any("forward" in vars(m) for m in model.modules())
    glm = _one_layer("glm4")  # a Llama-form forward with a partial, interleaved rotation
    with pytest.raises(ValueError, match="Glm4ForCausalLM has no attention module"):
        hybridsp.apply_lean_rope(glm)
    gemma = _one_layer("gemma2")  # another attention forward
    with pytest.raises(ValueError, match="Gemma2ForCausalLM has no attention module"):
        hybridsp.apply_lean_rope(gemma)
