"""Tiny random diffusers transformers (Wan 2.x, Flux, Qwen-Image) and full inputs for them.

``tiny_transformer(family, seed)`` builds one in float32 with random weights (every parameter,
including the zero-initialised output layers, drawn from one seeded generator, so gradients flow
everywhere); ``transformer_inputs(family, batch, tokens, text, seed)`` the keyword inputs of its
forward with ``tokens`` image tokens (odd counts allowed) and ``text`` text tokens.
"""

from __future__ import annotations

from typing import Any

import torch

FAMILY_NAMES = ("wan", "flux", "qwen", "qwen_edit")


def tiny_transformer(family: str, seed: int = 0, heads: int = 4, layers: int = 2) -> torch.nn.Module:
    """A random tiny transformer of ``family`` (2 layers, ``heads`` heads of 8 or 16)."""
    torch.manual_seed(seed)
    if family == "wan":
        from diffusers import WanTransformer3DModel

        model: torch.nn.Module = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers, cross_attn_norm=True, rope_max_seq_len=32,
        )  # fmt: skip
    elif family == "flux":
        from diffusers import FluxTransformer2DModel

        model = FluxTransformer2DModel(
            patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=heads, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(4, 6, 6),
        )  # fmt: skip
    elif family in ("qwen", "qwen_edit"):  # qwen_edit: zero_cond_t, the edit models' per-token modulation
        from diffusers import QwenImageTransformer2DModel

        model = QwenImageTransformer2DModel(
            patch_size=1, in_channels=8, out_channels=8, num_layers=layers, attention_head_dim=16,
            num_attention_heads=heads, joint_attention_dim=16, axes_dims_rope=(4, 6, 6),
            zero_cond_t=family == "qwen_edit",
        )  # fmt: skip
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILY_NAMES}")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    return model.float()


def transformer_inputs(
    family: str,
    batch: int = 2,
    tokens: int = 15,
    text: int = 5,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
    hidden_text: int = 0,
    rows_differ: bool = False,
    per_token_timesteps: bool = False,
) -> dict[str, Any]:
    """Keyword inputs of ``family``'s forward: ``tokens`` image tokens, ``text`` text tokens, ``batch`` rows.

    ``hidden_text``: Qwen-Image only, a text mask hiding the last that many text tokens, in every row alike or,
    with ``rows_differ``, ``hidden_text + i`` of them in row ``i`` (prompts of different lengths).

    Wan takes a video latent [B, 4, F, 2H', 2W'] with ``F * H' * W' = tokens`` (patch 1 x 2 x 2):
    ``tokens`` is factored as frames x height x 1; ``per_token_timesteps`` gives it one timestep per latent token
    ([B, tokens], Wan 2.2 TI2V).
    """
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    timestep = torch.rand(batch, generator=generator) * 1000
    if family == "wan":
        frames = next(f for f in (3, 5, 2, 1) if tokens % f == 0)
        latent = rand(batch, 4, frames, 2 * (tokens // frames), 2)  # [B, C, F, H, W]
        if per_token_timesteps:
            timestep = torch.rand(batch, tokens, generator=generator) * 1000  # [B, L]
        return {"hidden_states": latent, "timestep": timestep, "encoder_hidden_states": rand(batch, text, 16)}
    if family == "flux":
        img_ids = torch.stack([torch.zeros(tokens), torch.arange(tokens) // 4, torch.arange(tokens) % 4], dim=1)
        return {
            "hidden_states": rand(batch, tokens, 8),
            "encoder_hidden_states": rand(batch, text, 16),
            "pooled_projections": rand(batch, 8),
            "timestep": timestep / 1000,
            "img_ids": img_ids,  # [T_img, 3]
            "txt_ids": torch.zeros(text, 3),
        }
    if family in ("qwen", "qwen_edit"):
        height = next(h for h in (3, 5, 2, 1) if tokens % h == 0)
        shapes = [(1, height, tokens // height)]
        if family == "qwen_edit":  # the target image, then a condition image (modulated as at timestep 0)
            shapes = [(1, 1, tokens - tokens // 3), (1, 1, tokens // 3)]
        inputs = {
            "hidden_states": rand(batch, tokens, 8),
            "encoder_hidden_states": rand(batch, text, 16),
            "timestep": timestep / 1000,
            "img_shapes": [shapes] * batch,
        }
        if hidden_text:
            hidden = hidden_text + (torch.arange(batch) if rows_differ else torch.zeros(batch, dtype=torch.long))
            inputs["encoder_hidden_states_mask"] = torch.arange(text) < (text - hidden)[:, None]  # [B, T_txt]
        return inputs
    raise ValueError(f"unknown family {family!r}; one of {FAMILY_NAMES}")
