"""The one place that builds the tiny Hugging Face causal LMs the tests use.

``tiny_causal_lm("qwen2", seed=0, hidden_size=64, ...)``: a ``<Family>ForCausalLM`` whose config
holds exactly the given fields (transformers' defaults for the rest) and whose weights are fixed
by ``seed`` (``torch.manual_seed(seed)`` just before the model is built), cast to ``dtype``.
"""

from __future__ import annotations

import torch

CLASSES = {  # family -> (config class, model class) in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
}


def tiny_config(family: str = "llama", **fields):
    """The family's config with exactly ``fields`` set."""
    import transformers

    return getattr(transformers, CLASSES[family][0])(**fields)


def tiny_causal_lm(family: str = "llama", *, seed: int = 0, dtype: torch.dtype | None = torch.float32, **fields):
    """A causal LM of ``family`` from :func:`tiny_config`, weights from ``seed``, in ``dtype``
    (None: as built)."""
    import transformers

    config = tiny_config(family, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family][1])(config)
    return model if dtype is None else model.to(dtype)
