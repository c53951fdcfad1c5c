"""The token mixers of a model other than attention: the ones hybridsp switches, by identity, and the
ones it refuses.

Note [mixers by identity]: a module that mixes tokens across positions outside the attention call (a
recurrence, a convolution over the sequence, a state-space scan, a sparse indexer) would run on each
rank's shard alone, restarting at every shard boundary: silently wrong logits and gradients. So the
switch replaces such a module only when a :class:`MixerAdapter` claims it by *what it is* (its class,
module path and name, not a list of attribute names that another family's mixer may also have: Falcon-H1's
and Zamba2's Mamba mixers carry every attribute of Nemotron-H's and compute something else), and
:func:`unknown_mixers` finds every other one so that :func:`~hybridsp.integrations.transformers.apply`
refuses the model, naming the class, its layers and what to do, before anything changes.

:func:`mixing_evidence` is how an unclaimed module is recognised as a token mixer: a convolution whose
kernel spans more than one position, a torch recurrent layer, an own parameter or buffer of a state-space
or decay recurrence (``A_log``, ``dt_bias``, ``D``, ``A``, ``slope_rate``, ``time_decay``, ...), or a class
name of a known kind of mixer (Mamba, Mixer, SSM, Lightning, linear attention, DeltaNet, Indexer,
RG-LRU, RWKV, retention, Hyena, xLSTM, compressor, scan). The audit of every decoder family of
the installed transformers (``python -m tests.helpers.audit``, docs/model-support.md) checks the rule
against the unmodified models (transformers 5.25: every family the switch takes is exact at U1xR2).

Note [mixers under compile]: the default adapters' sharded forwards read the batch's documents on the host
(the segment plan of each row, the conv taps, the state-passing order), which a traced graph would take as
constants and guard on: a compiled Qwen3.5 built a new graph for every packing of one length. They are
therefore ``torch.compiler.disable``-d: inside a compiled model each mixer call is a graph boundary and runs
eagerly (as exact as eager, bit for bit), while attention, MLPs and norms compile; a new packing of the same
length reuses every graph (``tests/compile/test_linear_models.py``). Compiling the mixers' own math would need
them as custom operators with a recomputing backward, as the attention call is (docs/compile.md).

A user registers an adapter for a new mixer by implementing :class:`MixerAdapter` and passing it:
``apply(model, mesh, mixers=(*default_mixers(), MyMixerAdapter()))``; ``check_switchable`` takes the same
``mixers=`` so that the preflight and the switch stay one decision.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Callable, Protocol, cast

import torch
from torch import nn

from hybridsp.integrations.transformers._mixer_forwards import delta_rule_forward, mamba2_forward
from hybridsp.mesh._hybrid_mesh import HybridMesh

MARK = "_hybridsp_linear"  # set on every mixer a default adapter switched (removed by undo)

STATE_NAMES = frozenset({"A_log", "A", "D", "dt_bias", "slope_rate", "decay", "time_decay", "time_first"})
MIXER_NAME = re.compile(  # case-sensitive: "GptOssMLP" holds "ssM", not an SSM
    r"Mamba|Mixer|SSM|Ssm|Lightning|LinearAttention|DeltaNet|Indexer|Rglru|RGLRU|Rwkv|RWKV|Retention|Hyena|"
    r"[msx]LSTM|Compressor|Scan|ShortConv"
)

PER_TOKEN_SUFFIXES = ("Norm", "MLP", "Mlp", "Embedding", "Embeddings", "Experts", "Router", "Head")


class MixerAdapter(Protocol):
    """Switches one kind of token mixer (a module that mixes tokens outside the attention call) to run
    exactly over the mesh (Note [mixers by identity]).

    ``matches`` must recognise the module by identity (its class), never by the attribute names it has;
    ``check`` raises ValueError, before anything changes, for an instance that cannot run on ``mesh``
    (None: any mesh); ``switch`` replaces the instance's behaviour and returns a callable that undoes exactly
    that. Test an adapter against its family's unmodified model at U2xR2 or U1xR2.
    """

    name: str

    def matches(self, module: nn.Module) -> bool:
        """Whether this adapter switches ``module`` (by its class)."""
        ...

    def check(self, module: nn.Module, mesh: HybridMesh | None) -> None:
        """ValueError for an instance this adapter cannot run on ``mesh``."""
        ...

    def switch(self, module: nn.Module, mesh: HybridMesh) -> Callable[[], None]:
        """Make ``module`` run over ``mesh``; returns the undo."""
        ...


def qualified_name(klass: type) -> str:
    """``transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet``: what identity means here."""
    return f"{klass.__module__}.{klass.__qualname__}"


class RecurrentMixerAdapter:
    """A :class:`MixerAdapter` for the transformers classes whose forward one of hybridsp's sharded forwards
    reproduces: ``kind`` ``"delta_rule"`` (Gated DeltaNet) or ``"mamba2"`` (Mamba-2), ``classes`` their
    qualified names. The kernel is the modeling module's own function (``kernel_name``)."""

    def __init__(self, name: str, kind: str, classes: tuple[str, ...], kernel_name: str, units: str):
        self.name, self.kind, self.classes, self.kernel_name, self.units = name, kind, classes, kernel_name, units

    def matches(self, module: nn.Module) -> bool:
        return qualified_name(type(module)) in self.classes

    def check(self, module: nn.Module, mesh: HybridMesh | None) -> None:
        self._kernel(module)
        if hasattr(module, MARK):
            raise ValueError(f"{_label(module)} is already switched to hybridsp: undo the first switch first")
        groups = cast(int, getattr(module, self.units))  # a plain int of the mixer's config
        what = "key heads" if self.kind == "delta_rule" else "B/C groups"
        if mesh is not None and groups % mesh.ulysses:
            raise ValueError(
                f"{_label(module)} has {groups} {what}, not divisible by the Ulysses degree {mesh.ulysses} (each rank "
                f"must hold whole groups); choose a Ulysses degree that divides {groups} and move the rest of the "
                f"context ranks to the ring"
            )

    def switch(self, module: nn.Module, mesh: HybridMesh) -> Callable[[], None]:
        previous = module.__dict__.get("forward")
        module.forward = functools.partial(_EAGER[self.kind], module, mesh, self._kernel(module))
        setattr(module, MARK, self.kind)
        return functools.partial(_restore, module, previous)

    def _kernel(self, module: nn.Module):
        kernel = getattr(sys.modules.get(type(module).__module__), self.kernel_name, None)
        if kernel is None:
            raise ValueError(
                f"{_label(module)}: its modeling module defines no {self.kernel_name}, the kernel hybridsp calls"
            )
        return kernel


def _restore(module: nn.Module, previous) -> None:
    if not hasattr(module, MARK):
        return  # undone already
    delattr(module, MARK)
    if previous is None:
        del module.forward
    else:
        module.forward = previous


_EAGER = {  # Note [mixers under compile]
    "delta_rule": torch.compiler.disable(delta_rule_forward, recursive=True),
    "mamba2": torch.compiler.disable(mamba2_forward, recursive=True),
}
_MODELS = "transformers.models."
DELTA_RULE = RecurrentMixerAdapter(
    "Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)",
    "delta_rule",
    (
        _MODELS + "qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet",
        _MODELS + "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet",
        _MODELS + "qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
    ),
    "torch_chunk_gated_delta_rule",
    "num_k_heads",
)
MAMBA2 = RecurrentMixerAdapter(
    "Mamba-2 (Nemotron-H)",
    "mamba2",
    (_MODELS + "nemotron_h.modeling_nemotron_h.NemotronHMamba2Mixer",),
    "mamba2_chunk_scan",
    "n_groups",
)


def default_mixers() -> tuple[MixerAdapter, ...]:
    """The mixer adapters :func:`~hybridsp.integrations.transformers.apply` uses unless given others: Gated
    DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) and Mamba-2 (Nemotron-H)."""
    return (DELTA_RULE, MAMBA2)


def claimed_mixers(model: nn.Module, mixers) -> list[tuple[nn.Module, MixerAdapter]]:
    """Every module under ``model`` an adapter of ``mixers`` claims, with that adapter, in module order."""
    found = []
    for module in model.modules():
        adapter = next((a for a in mixers if a.matches(module)), None)
        if adapter is not None:
            found.append((module, adapter))
    return found


def mixing_evidence(module: nn.Module) -> str | None:
    """Why ``module`` mixes tokens across positions, judged by what it is (Note [mixers by identity]), or None."""
    klass = type(module)
    if isinstance(module, nn.RNNBase):
        return "a recurrent layer"
    if isinstance(module, nn.modules.conv._ConvNd) and _kernel_positions(module) > 1:
        return "a convolution over the sequence"
    state = sorted(STATE_NAMES & {*module._parameters, *module._buffers})
    if state:
        return f"its own parameter {state[0]!r}, the mark of a state-space, decay or dynamic-mask mixer"
    if klass.__module__.startswith("torch."):
        return None
    named = MIXER_NAME.search(klass.__name__)
    if named is None or klass.__name__.endswith(PER_TOKEN_SUFFIXES):
        return None  # a family's norm or MLP (MambaRMSNorm) carries the family's name, not a mixer's
    if any(MIXER_NAME.search(type(m).__name__) for m in list(module.modules())[1:]):
        return None  # a layer holding a mixer (JambaMambaDecoderLayer) is reported as that mixer
    return f"a token mixer by its class ({named.group(0)!r})"


def _kernel_positions(conv: nn.Module) -> int:
    size = 1
    for extent in cast(tuple, conv.kernel_size):
        size *= int(extent)
    return size


def unknown_mixers(model: nn.Module, claimed: list[nn.Module]) -> dict[str, tuple[str, list[str]]]:
    """Token mixers under ``model`` that no adapter claims: ``{class name: (why, [where])}``. A claimed
    mixer's own submodules (its convolution) are its adapter's business."""
    inside = {id(child) for mixer in claimed for child in mixer.modules()}
    found: dict[str, tuple[str, list[str]]] = {}
    for path, module in model.named_modules():
        if id(module) in inside:
            continue
        why = mixing_evidence(module)
        if why is not None:
            name = _reported_name(model, path, module)
            found.setdefault(name, (why, []))[1].append(_layer_of(path))
    return found


def _reported_name(model: nn.Module, path: str, module: nn.Module) -> str:
    """How a refusal names the mixer at ``path``: its own class; for a torch layer (a convolution) the nearest
    enclosing module that is a mixer by name (the Mamba mixer), else ``Parent.attribute``
    (``ZayaCCAProjection.conv_qk_depthwise``)."""
    parts = path.split(".")
    if not type(module).__module__.startswith("torch."):
        return type(module).__name__
    for end in range(len(parts) - 1, 0, -1):
        klass = type(model.get_submodule(".".join(parts[:end])))
        if MIXER_NAME.search(klass.__name__):
            return klass.__name__
    if type(module).__module__.startswith("torch.") and len(parts) > 1:
        return f"{type(model.get_submodule('.'.join(parts[:-1]))).__name__}.{parts[-1]}"
    return type(module).__name__


def _layer_of(path: str) -> str:
    """``model.layers.3.mixer.conv1d`` -> ``"3"``; a path outside numbered layers as itself."""
    numbers = re.findall(r"\.(\d+)(?=\.|$)", "." + path)
    return numbers[0] if numbers else path or "<model>"


def refuse_unknown_mixers(model: nn.Module, claimed: list[nn.Module]) -> None:
    """ValueError, one line, naming every token mixer no adapter claims, its layers and what to do."""
    found = unknown_mixers(model, claimed)
    if not found:
        return
    parts = [f"{name} in layers {', '.join(_compact(where))} ({why})" for name, (why, where) in sorted(found.items())]
    raise ValueError(
        f"{type(model).__name__} mixes tokens outside attention in modules hybridsp does not implement: "
        f"{'; '.join(parts)}. Run per shard they would restart at every shard boundary (silently wrong), so "
        f"nothing was switched. Train this model without sequence parallelism, or implement a MixerAdapter for "
        f"them and pass apply(model, mesh, mixers=(*default_mixers(), YourAdapter())) (docs/model-support.md)"
    )


def _compact(where: list[str]) -> list[str]:
    """Distinct layers in first-seen order, at most 6 then a count."""
    distinct = list(dict.fromkeys(where))
    return distinct if len(distinct) <= 6 else distinct[:6] + [f"... ({len(distinct)} in all)"]


def _label(module: nn.Module) -> str:
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
