"""The attention forwards read line by line: Llama's, Mistral's, Qwen2's, Qwen3's (52 transformers classes).

Each hands q, k, v to the attention function alone: q and k are RoPE's fresh outputs, v a view of its
projection's output, and none is used after the call. Donated q/k/v (:mod:`hybridsp.memory._qkv_donation`)
and lean RoPE (:mod:`hybridsp.memory._rope_attention`) rest on that, and take a class when its forward is
one of these statement for statement (:func:`hybridsp.memory._forward_form.has_forward_of`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, cast

from torch import nn

from hybridsp.memory._forward_form import has_forward_of

HANDS_QKV_ALONE = "_hybridsp_hands_qkv_alone"  # set on an instance forward that hands q, k, v to attention alone


@dataclass(frozen=True)
class AttentionForm:
    """One read attention forward: its family, class, whether it norms q and k per head (Qwen3), and
    how it passes the sliding window to the attention function (None: it passes none)."""

    family: str
    name: str
    qk_norm: bool
    sliding_window: Callable[[nn.Module], Any] | None

    def reference(self) -> type:
        """The transformers class whose forward this is."""
        module = importlib.import_module(f"transformers.models.{self.family}.modeling_{self.family}")
        return cast(type, getattr(module, self.name))


FORMS = (
    AttentionForm("llama", "LlamaAttention", False, None),
    AttentionForm("mistral", "MistralAttention", False, lambda m: getattr(m.config, "sliding_window", None)),
    AttentionForm("qwen2", "Qwen2Attention", False, lambda m: m.sliding_window),
    AttentionForm("qwen3", "Qwen3Attention", True, lambda m: m.sliding_window),
)


def read_form(cls: type) -> AttentionForm | None:
    """The form ``cls.forward`` is, or None."""
    return next((form for form in FORMS if has_forward_of(cls, form.reference())), None)
