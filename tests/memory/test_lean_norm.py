"""apply_lean_norms against the unmodified Hugging Face norms and models: outputs, every gradient, memory kept.

(Under ZeRO-3 with sequence parallelism: tests/benchmarks/test_alst_parity.py, "best" features.)
"""

import importlib

import pytest
import torch

from hybridsp.memory._lean_norm import LLAMA_STYLE_NORMS, apply_lean_norms, lean_rms_norm
from tests.helpers.models.tiny import tiny_causal_lm
from tests.helpers.references.attention import rel_err

MODULES = {  # class -> transformers module holding it
    "LlamaRMSNorm": "llama",
    "MistralRMSNorm": "mistral",
    "MixtralRMSNorm": "mixtral",
    "Qwen2RMSNorm": "qwen2",
    "Qwen2MoeRMSNorm": "qwen2_moe",
    "Qwen3RMSNorm": "qwen3",
    "Qwen3MoeRMSNorm": "qwen3_moe",
    "Phi3RMSNorm": "phi3",
}
TOLERANCE = {
    torch.float64: 2e-6,
    torch.float32: 2e-6,
    torch.bfloat16: 2e-2,
}  # HF's norm computes fp64 input in fp32 too


def _norm_class(name: str):
    module = importlib.import_module(f"transformers.models.{MODULES[name]}.modeling_{MODULES[name]}")
    return getattr(module, name)


def _grads(norm, x, grad):
    x = x.detach().requires_grad_(True)
    norm.zero_grad(set_to_none=True)
    out = norm(x)
    out.backward(grad)
    return out.detach(), x.grad, norm.weight.grad


def test_every_listed_class_is_known():
    assert set(MODULES) == LLAMA_STYLE_NORMS


@pytest.mark.parametrize("name", sorted(LLAMA_STYLE_NORMS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_lean_norm_equals_the_class_forward(name, dtype):
    """Each listed class, strided [B=2, 37, 24] input, tiles of 16 rows (74 rows: 5 tiles, the last short):
    the output is bit-identical, dx and dweight equal autograd's (rounding)."""
    norm = _norm_class(name)(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=torch.Generator().manual_seed(1)).to(dtype))
    x = (
        torch.randn(37, 2, 24, generator=torch.Generator().manual_seed(0)).to(dtype).transpose(0, 1)
    )  # [2, 37, 24], strided
    grad = torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    want = _grads(norm, x, grad)
    handle = apply_lean_norms(torch.nn.ModuleList([norm]), tile_tokens=16)
    got = _grads(norm, x, grad)
    handle.undo()
    assert torch.equal(got[0], want[0]), f"{name} {dtype}: forward differs"
    for what, g, w in zip(("dx", "dweight"), got[1:], want[1:]):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert rel_err(g, w) <= TOLERANCE[dtype], f"{name} {dtype} {what}: rel {rel_err(g, w):.2e}"


def test_head_dim_norm_and_no_weight_grad():
    """Qwen3's q/k norms act on [B, S, H, D]; a frozen weight gets no gradient, x still does (as autograd's)."""
    norm = _norm_class("Qwen3RMSNorm")(8, eps=1e-6)
    norm.weight.requires_grad_(False)
    x = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(2, 5, 3, 8, generator=torch.Generator().manual_seed(1))
    want = _grads(norm, x, grad)
    with apply_lean_norms(torch.nn.ModuleList([norm]), tile_tokens=4):
        got = _grads(norm, x, grad)
    assert torch.equal(got[0], want[0]) and got[2] is None and want[2] is None
    assert rel_err(got[1], want[1]) <= 2e-6
    assert torch.equal(lean_rms_norm(x, norm.weight, norm.variance_epsilon), want[0])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_model_loss_and_gradients_equal_hf(checkpointing):
    """A tiny Llama (and its gradient-checkpointed run), B=2: loss and every parameter gradient as unmodified."""
    model = tiny_causal_lm(
        "llama",
        seed=0,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        attn_implementation="sdpa",
    )
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return [out.loss.detach()] + [p.grad.clone() for p in model.parameters()]

    want = run()
    with apply_lean_norms(model) as handle:
        assert len(handle.modules) == 2 * 2 + 1
        got = run()
    assert all("forward" not in vars(m) for m in handle.modules)
    assert torch.equal(got[0], want[0])
    for (name, _), g, w in zip(model.named_parameters(), got[1:], want[1:]):
        assert rel_err(g, w) <= 2e-6, f"{name}: rel {rel_err(g, w):.2e}"


def test_lean_norm_keeps_no_normalized_copy():
    """What autograd keeps for backward: HF's norm keeps x and the normalized [T, h] rows; the lean one x and rstd."""
    norm = _norm_class("LlamaRMSNorm")(256)
    x = torch.randn(1, 1024, 256, requires_grad=True)

    def saved_bytes():
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t) or t, lambda t: t):
            norm(x).sum()
        unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sizes}
        return sum(unique.values()) - x.untyped_storage().nbytes() - norm.weight.untyped_storage().nbytes()

    hf = saved_bytes()
    with apply_lean_norms(torch.nn.ModuleList([norm])):
        lean = saved_bytes()
    assert hf >= 1024 * 256 * 4 and lean == 1024 * 4, (hf, lean)


def test_bad_input_raises():
    model = tiny_causal_lm(
        "gemma2",
        seed=0,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    with pytest.raises(ValueError, match="has no Llama-style RMSNorm"):
        apply_lean_norms(model)
    llama = tiny_causal_lm(
        "llama",
        seed=0,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(ValueError, match=r"positive number of rows \(tokens\); got 0"):
        apply_lean_norms(llama, tile_tokens=0)
    apply_lean_norms(llama)
    with pytest.raises(ValueError, match="switched twice"):
        apply_lean_norms(llama)


def test_compiled_model_with_lean_norms_equals_eager_hf():
    """torch.compile (aot_eager, fullgraph=True) of a tiny Llama with lean norms: loss and gradients as unmodified eager."""
    model = tiny_causal_lm(
        "llama",
        seed=0,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        attn_implementation="sdpa",
    )
    ids = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(0))

    def run(call):
        model.zero_grad(set_to_none=True)
        out = call(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return [out.loss.detach()] + [p.grad.clone() for p in model.parameters()]

    want = run(model)
    with apply_lean_norms(model):
        got = run(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert rel_err(got[0], want[0]) <= 1e-6
    for (name, _), g, w in zip(model.named_parameters(), got[1:], want[1:]):
        assert rel_err(g, w) <= 2e-6, f"{name}: rel {rel_err(g, w):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planner_norm_term_is_what_a_decoder_layer_keeps(dtype):
    """hybridsp.planner._memory's lean-norm saving (two norms per layer) equals what autograd stops keeping
    for one HF Llama decoder layer (unique storages of the saved tensors, HF norms vs lean)."""
    from hybridsp.planner._memory import norm_bytes_per_token
    from hybridsp.planner._specs import ModelSpec

    model = tiny_causal_lm(
        "llama",
        seed=0,
        dtype=dtype,
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    tokens = 96
    hidden = torch.randn(1, tokens, 64, dtype=dtype, requires_grad=True)
    positions = torch.arange(tokens).unsqueeze(0)
    embeddings = model.model.rotary_emb(hidden, positions)

    def kept() -> int:
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model.layers[0](hidden * 1, position_embeddings=embeddings, position_ids=positions)
        return sum(seen.values())

    spec = ModelSpec(
        num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=128, num_layers=1, vocab_size=64
    )
    e = torch.empty((), dtype=dtype).element_size()
    predicted = 2 * tokens * (norm_bytes_per_token(spec, e) - norm_bytes_per_token(spec, e, lean=True))
    hf = kept()
    with apply_lean_norms(model):
        lean = kept()
    assert hf - lean == predicted, (hf, lean, predicted)
