"""What :func:`hybridsp.integrations.transformers.apply` leaves on each attention module, and the
decode keyword: the names the switch, generation (:mod:`.hf_generate`) and the Trainer share
(Note [binding the mesh] in :mod:`hybridsp.integrations.transformers`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from hybridsp._types import BackendName, HeadChunks
from hybridsp.kernels import AttentionKernel
from hybridsp.mesh._hybrid_mesh import HybridMesh

NAME = "hybridsp"  # the attention implementation the switch registers with transformers
BINDING_ATTR = "_hybridsp_binding"  # the attribute apply() sets on every attention module it switches
DECODE_KWARG = "hybridsp_decode"  # the model-call kwarg that carries a decode step (hf_generate)


@dataclass(frozen=True)
class Binding:
    """What one attention module needs at call time (set by ``apply``)."""

    mesh: HybridMesh
    backend: BackendName | AttentionKernel
    head_chunks: HeadChunks | None = None  # None: the mesh's (hybrid_attn_func's head_chunks)
    tap: Callable[..., Any] | None = None  # the exactness probe's recorder (hybridsp.monitor), set for one pass


DOCUMENTS_KWARG = "hybridsp_documents"  # the model-call kwarg that carries the batch's Documents (shard_batch)


INTERFACE_NAME = "ALL_ATTENTION_FUNCTIONS"  # transformers' attention interface: what a switchable module calls


def calls_attention_interface(module) -> bool:
    """True when a method of ``module``'s own classes looks up transformers' attention interface.

    Note [found by what they are]: an attention module that hybridsp can take is one whose code
    reaches the attention function through ``ALL_ATTENTION_FUNCTIONS`` (``get_interface`` /
    ``[...]``): that call is the one ``"hybridsp"`` replaces. The name is read from the methods'
    compiled code (``co_names``), so the test does not depend on projection names (Phi-3's fused
    ``qkv_proj``, DeepSeek-V3's MLA projections) or model types. A whole model (a
    ``PreTrainedModel``, whose own methods name the interface to configure it) is not an attention
    module, nor is anything of torch's. The answer depends on the class only.
    """
    return _class_calls_interface(type(module))


def _class_calls_interface(klass: type) -> bool:
    """:func:`calls_attention_interface` for every instance of ``klass``."""
    from transformers import PreTrainedModel

    if issubclass(klass, PreTrainedModel):
        return False
    return any(
        INTERFACE_NAME in _names_of(value)
        for base in klass.__mro__
        if not base.__module__.startswith("torch")
        for value in vars(base).values()
    )


def _names_of(value) -> tuple[str, ...]:
    """The global and attribute names a function's code refers to (empty for non-functions)."""
    function = inspect.unwrap(value) if inspect.isfunction(value) else None
    return function.__code__.co_names if function is not None else ()


def attention_modules(root) -> list:
    """The attention modules under ``root`` (an ``nn.Module``) the switch can take, in module order
    (Note [found by what they are])."""
    answers: dict[type, bool] = {}  # per class, once per walk: a model repeats a few classes many times
    found = []
    for module in root.modules():
        klass = type(module)
        if klass not in answers:
            answers[klass] = _class_calls_interface(klass)
        if answers[klass]:
            found.append(module)
    return found
