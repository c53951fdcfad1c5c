"""Tiny hybrid linear-attention HF models (Qwen3.5 text, Qwen3-Next, Nemotron-H) and the references the
linear-layer tests compare against: the unmodified model on the whole rows, or run per document."""

from __future__ import annotations

import functools

import torch

from tests.helpers.models import packed

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, max_position_embeddings=256, attn_implementation="sdpa", pad_token_id=0)
FAMILIES = {  # family -> (config class, model class, fields); linear heads: Hk < Hv, odd value head dim
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_conv_kernel_dim=4,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_conv_kernel_dim=4,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_experts=0,
            decoder_sparse_step=1,
            mlp_only_layers=[0, 1],
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=6,
            n_groups=2,
            ssm_state_size=8,
            conv_kernel=4,
            chunk_size=16,
            layers_block_type=["mamba", "attention", "mamba", "mlp"],
        ),
    ),
}


def tiny_hybrid(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **fields):
    """A small hybrid causal LM of ``family``, weights fixed by ``seed``; decays slowed so every token
    keeps a say in the state (the default init forgets within a few tokens, which would hide errors)."""
    import transformers

    config_class, model_class, defaults = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **defaults, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(dtype)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.copy_(torch.linspace(-3.0, -1.0, module.A_log.numel()))
                module.dt_bias.copy_(torch.linspace(-1.0, 0.5, module.dt_bias.numel()))
    return model


def packed_batch(rows: tuple[tuple[int, ...], ...], seed: int = 0) -> dict:
    """input_ids/labels [B, S] and position_ids restarting at 0 at every document (S: the first row's total)."""
    return packed.packed_batch(rows, sum(rows[0]), seed, VOCAB)


per_document_reference = packed.per_document_reference  # the unmodified model on every document by itself


def per_document_mixers(model) -> None:
    """Make ``model``'s unmodified recurrent mixers run every packed document by itself: the one-process reference
    for packed rows (transformers' CPU fallbacks run straight across documents). A document starts wherever the
    model call's ``position_ids`` are 0 (a forward pre-hook on ``model`` reads them); calls with a cache run as
    they are."""
    seen = {}
    model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(position_ids=kwargs.get("position_ids")), with_kwargs=True
    )
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "conv1d"):
            module.forward = functools.partial(_run_per_document, module.forward, seen)


def _run_per_document(forward, seen: dict, hidden_states, cache=None, attention_mask=None, **kwargs):
    positions = seen.get("position_ids")
    if positions is None or cache is not None:
        return forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    rows = []
    for b in range(hidden_states.shape[0]):
        starts = sorted({0, *(positions[b] == 0).nonzero().flatten().tolist(), hidden_states.shape[1]})
        mask = lambda s, e: None if attention_mask is None else attention_mask[b : b + 1, s:e]  # noqa: E731
        rows.append(
            torch.cat(
                [forward(hidden_states[b : b + 1, s:e], attention_mask=mask(s, e)) for s, e in zip(starts, starts[1:])],
                dim=1,
            )
        )  # [1, S, hidden]
    return torch.cat(rows, dim=0)  # [B, S, hidden]
