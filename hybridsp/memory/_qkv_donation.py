"""When an attention call may hand its q, k, v storage to their gradients (``donate_inputs``).

Note [donated q/k/v]: the head-chunked backward without Ulysses (``head_chunks`` > 1, U = 1) keeps
q, k, v for backward and, given ``donate_inputs=True``, writes each head group's dq, dk, dv into that
group's heads of q, k, v once the group's backward is done, instead of into three new tensors
(:mod:`hybridsp.attention._head_chunks`): three ``[B, S_local, H(kv), D]`` tensors fewer at the
attention backward's peak, which bounds the longest step under split checkpointing. That is only
right when nothing else reads q, k or v afterwards, and the transformers switch donates only where it
can tell:

- the attention module's forward is, statement for statement (:mod:`hybridsp.memory._forward_form`),
  that of Llama, Mistral, Qwen2 or Qwen3 (52 transformers classes: Mixtral, Qwen2/3-MoE, Gemma,
  Granite, GLM, ...): q and k are RoPE's fresh outputs, v a view of its projection's output, all three
  handed to the attention function alone (read in each of the four; some modules reuse them
  after the call: NeoMME's ``exclusive_self_attention(out, value_states)``, DiffLlama's second
  attention);
- the call runs inside an activation-checkpointed region (:func:`in_checkpointed_region`): the
  tensors backward sees are the region's recomputed ones, which no caller holds, and transformers
  drops the KV cache under checkpointing (a cache would hold k and v);
- the exactness probe is not recording the call (it keeps q, k, v).

The in-place writes bump q, k and v's version counters, so any autograd use of them after the
gradients were written raises instead of reading gradients (a second backward through a retained
graph of a reentrant checkpoint, for instance).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridsp.memory._attention_forms import HANDS_QKV_ALONE, read_form
from hybridsp.memory._norm_rebuild import enclosing_hooks

_CHECKPOINT_MODULE = "torch.utils.checkpoint"


def in_checkpointed_region() -> bool:
    """True inside activation checkpointing whose backward recomputes what is computed now: the
    recompute of a reentrant checkpoint (a forward running during a backward pass), or the forward of
    a non-reentrant one (torch's checkpoint saved-tensor hooks are the innermost, but for a
    :class:`~hybridsp.memory._norm_rebuild.NormInputKept`'s)."""
    if torch._C._current_graph_task_id() >= 0:
        return True
    hooks = enclosing_hooks()  # through the attention half's NormInputKept
    if not hooks:
        return False
    pack = hooks[0]
    return getattr(pack, "__module__", None) == _CHECKPOINT_MODULE and "_checkpoint_hook" in pack.__qualname__


def hands_qkv_to_attention_alone(cls: type) -> bool:
    """True when ``cls.forward`` is one of the forwards read for Note [donated q/k/v]."""
    return read_form(cls) is not None


def _runs_read_forward(module: nn.Module) -> bool:
    """The class's forward runs (an instance-level forward was not read), or lean RoPE's, which hands q,
    k, v to the attention function alone as the forms it replaces do (:mod:`hybridsp.memory._rope_attention`)."""
    instance_forward = vars(module).get("forward")
    return instance_forward is None or getattr(instance_forward, HANDS_QKV_ALONE, False)


def may_donate_qkv(module: nn.Module, recording: bool) -> bool:
    """Whether the switch's attention call for ``module`` may donate q, k, v now (Note [donated q/k/v]);
    ``recording``: the exactness probe records this call."""
    if recording or not torch.is_grad_enabled() or not _runs_read_forward(module):
        return False
    return in_checkpointed_region() and hands_qkv_to_attention_alone(type(module))
