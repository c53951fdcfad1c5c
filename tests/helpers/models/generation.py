"""Tiny fp32 Hugging Face causal LMs for the generation tests, their prompts, the unmodified model's own
generate, and a launch whose ranks return tensors as bytes."""

import io

import torch

from hybridsp.testing import run_distributed
from tests.helpers.models.tiny import tiny_causal_lm

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=256,
    pad_token_id=0,
    attn_implementation="sdpa",
)
FAMILIES = {  # (config class, model class, overrides); heads H / H_kv
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=1)),  # MQA
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),  # q/k/v bias
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_attention_heads=8, num_key_value_heads=2, sliding_window=None),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
}


def build(family: str, seed: int = 0, dtype=torch.float32):
    return tiny_causal_lm(family, seed=seed, dtype=dtype, **COMMON, **FAMILIES[family][2]).eval()


def prompt(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, COMMON["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(seed))[:batch]


def reference_generate(model, ids, **kwargs):
    """(ids [B, S + new], raw logits [B, new, V]) of the unmodified model's own generate."""
    out = model.generate(ids, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)


def portable(value) -> bytes:
    """A rank's result as bytes (torch.save): tensors sent through the launcher's queue are otherwise shared by
    file descriptor, which the parent cannot open once the rank's process has exited (ConnectionResetError)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def launch(fn, world, *args):
    return [torch.load(io.BytesIO(raw)) for raw in run_distributed(fn, world, *args, timeout=300)]
