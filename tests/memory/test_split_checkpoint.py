"""Split checkpointing (``apply_split_checkpointing``) against HF's layer-level checkpointing, one process.

The reference is the same model checkpointed layer by layer (``gradient_checkpointing_enable()``): the
loss, the input embeddings' gradient and every parameter's gradient must be bitwise equal (the same ops
in the same order), for Llama, Qwen3 (q/k norms) and Qwen3-MoE, fp32 and fp64, B = 2 with a padding
mask, non-reentrant and reentrant checkpointing, alone and with lean norms, tiled MLP and activation
offload. The backward recomputes each layer's MLP half before its attention half, each once; both
halves' inputs go to host under the offload. Errors name the layer class.
"""

import pytest
import torch
from torch import nn

import hybridsp
from tests.helpers.models.tiny import tiny_causal_lm

VOCAB, LAYERS, SEQ = 64, 3, 20


def _model(family: str, dtype: torch.dtype, reentrant: bool = False) -> nn.Module:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    if family == "qwen3_moe":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    model = tiny_causal_lm(family, seed=0, dtype=dtype, **fields).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def _batch() -> dict:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :4] = 0  # left padding on the second row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _step(model: nn.Module, offload=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    embeds = model.get_input_embeddings()(_batch()["input_ids"]).detach().requires_grad_()
    batch = {key: value for key, value in _batch().items() if key != "input_ids"}
    if offload is None:
        loss = model(inputs_embeds=embeds, **batch).loss
    else:
        with offload:
            loss = model(inputs_embeds=embeds, **batch).loss
    loss.backward()
    return loss.detach(), [embeds.grad] + [p.grad for p in model.parameters() if p.requires_grad]


def _assert_bitwise(got, want) -> None:
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1]):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)


CASES = [  # transformers' grouped expert matmul takes no fp64: the MoE family in fp32 only
    (family, dtype) for family in ("llama", "qwen3", "qwen3_moe") for dtype in (torch.float32, torch.float64)
][:-1]


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_split_equals_layer_checkpointing_bitwise(family, dtype, reentrant):
    want = _step(_model(family, dtype, reentrant))
    model = _model(family, dtype, reentrant)
    handle = hybridsp.apply_split_checkpointing(model)
    assert len(handle.modules) == LAYERS and handle.tile_tokens is None
    _assert_bitwise(_step(model), want)


def test_split_composes_with_lean_norms_tiled_mlp_and_offload():
    def prepared():
        model = _model("llama", torch.float32)
        hybridsp.apply_lean_norms(model)
        hybridsp.apply_tiled_mlp(model, tile_tokens=7)
        return model

    reference = prepared()
    want = _step(reference, hybridsp.offload_activations(reference))
    model = prepared()
    hybridsp.apply_split_checkpointing(model)
    offload = hybridsp.offload_activations(model)
    _assert_bitwise(_step(model, offload), want)
    local = 2 * SEQ * 32 * 4  # [B, S, h] fp32 bytes
    assert offload.stats.offloaded_tensors == 2 * LAYERS - 1 and offload.stats.kept_tensors == 1, offload.stats
    assert offload.stats.offloaded_bytes == (2 * LAYERS - 1) * local
    assert offload.stats.restored_tensors == 2 * LAYERS - 1


def test_offloaded_half_inputs_are_not_held_on_the_device_after_the_forward():
    """Nothing in the halves (the attention half's NormInputKept included) holds an offloaded input."""
    model = _model("llama", torch.float32)
    hybridsp.apply_lean_norms(model)
    hybridsp.apply_split_checkpointing(model)
    offload = hybridsp.offload_activations(model)
    inputs = []  # the storage of each half's input: layer i's x, then its h1
    for layer in model.model.layers:
        for entry in (layer, layer.post_attention_layernorm):
            entry.register_forward_pre_hook(
                lambda module, args, kwargs: inputs.append(
                    (args[0] if args else kwargs["hidden_states"]).untyped_storage()
                ),
                with_kwargs=True,
            )
    batch = {key: value for key, value in _batch().items()}
    with offload:
        loss = model(**batch).loss
    held = [torch._C._storage_Use_Count(storage._cdata) > 1 for storage in inputs]
    assert held == [False] * (2 * LAYERS - 1) + [True], held  # the newest stays (keep_last=1)
    loss.backward()


def test_backward_recomputes_the_mlp_half_then_the_attention_half_once_each():
    model = _model("llama", torch.float32)
    hybridsp.apply_split_checkpointing(model)
    calls: list[str] = []
    for i, layer in enumerate(model.model.layers):
        # pre-hooks: a non-reentrant recompute stops once the last saved tensor is made, before forward hooks
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.append(f"attn{i}"))
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.append(f"mlp{i}"))
    embeds = model.get_input_embeddings()(_batch()["input_ids"])
    loss = model(inputs_embeds=embeds, labels=_batch()["labels"]).loss
    forward = list(calls)
    calls.clear()
    loss.backward()
    assert forward == [f"{part}{i}" for i in range(LAYERS) for part in ("attn", "mlp")]
    assert calls == [f"{part}{i}" for i in reversed(range(LAYERS)) for part in ("mlp", "attn")], calls


def test_unsplit_where_hf_would_not_checkpoint_and_undo_restores():
    model = _model("llama", torch.float32)
    batch = _batch()
    with torch.no_grad():
        want = model(**batch).logits
    handle = hybridsp.apply_split_checkpointing(model)
    layer = model.model.layers[0]
    hidden = torch.randn(2, SEQ, 32)
    position = torch.arange(SEQ).expand(2, SEQ)
    cos_sin = model.model.rotary_emb(hidden, position)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, want)
        # positional arguments as the layer documents them: (hidden_states, attention_mask, position_ids)
        assert torch.equal(
            layer(hidden, None, position, position_embeddings=cos_sin),
            type(layer).forward(layer, hidden, None, position, position_embeddings=cos_sin),
        )
    model.train()
    got = layer(hidden, None, position, position_embeddings=cos_sin)  # split: positional names bound
    assert torch.equal(got, type(layer).forward(layer, hidden, None, position, position_embeddings=cos_sin))
    handle.undo()
    assert all("forward" not in vars(m) for m in model.model.layers)


def test_bad_models_raise_value_errors_naming_the_class():
    with pytest.raises(ValueError, match="no Hugging Face decoder layer"):
        hybridsp.apply_split_checkpointing(nn.Linear(2, 2))
    gemma2 = tiny_causal_lm(
        "gemma2",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
    )
    with pytest.raises(ValueError, match="Gemma2DecoderLayer.*not LlamaDecoderLayer's"):
        hybridsp.apply_split_checkpointing(gemma2)
    assert all("forward" not in vars(m) for m in gemma2.modules())  # nothing changed
    model = _model("llama", torch.float32)
    hybridsp.apply_split_checkpointing(model)
    with pytest.raises(ValueError, match="switched twice"):
        hybridsp.apply_split_checkpointing(model)
