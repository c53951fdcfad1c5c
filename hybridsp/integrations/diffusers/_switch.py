"""``apply(transformer, mesh)``: a diffusers transformer's attention switched to hybrid U x R, undoably.

What changes (all of it on this transformer's modules and processors, undone by ``handle.undo()``):

- each attention processor's ``_parallel_config`` becomes a ``Route`` (``_route``), and the processor
  module's ``dispatch_attention_fn`` a ``Router`` that sends such calls to ``hybrid_attn_func``;
- a forward pre-hook on the transformer builds the forward's token plan (``_plan``) from the full
  inputs and cuts the inputs the family names (``_families``); hooks on the named submodules cut
  their inputs or outputs (latent tokens, text tokens, RoPE positions);
- a forward hook on the output projection gathers the image tokens, so the transformer returns the
  full output on every rank.

Every check runs in :func:`apply` or in the forward before the first collective, on every rank alike.
"""

from __future__ import annotations

import fnmatch
import sys
from collections import defaultdict
from typing import Any, Callable

import torch

from hybridsp._types import BackendName
from hybridsp.integrations.diffusers._families import Cut, Family, bind, family_of
from hybridsp.integrations.diffusers._plan import build_plan
from hybridsp.integrations.diffusers._route import ForwardState, Route, install_router
from hybridsp.integrations.diffusers._rows import install_row_split, rows_differ
from hybridsp.integrations.diffusers._sharding import gather_slots, take_slots
from hybridsp.mesh import HybridMesh

Undo = Callable[[], None]


class DiffusersHandle:
    """What :func:`apply` changed; ``undo()`` restores the transformer and diffusers as they were."""

    def __init__(self, transformer: torch.nn.Module, mesh: HybridMesh, family: Family, state: ForwardState) -> None:
        self.transformer, self.mesh, self.family, self.state = transformer, mesh, family, state
        self._undos: list[Undo] = []

    @property
    def active(self) -> bool:
        return bool(self._undos)

    def undo(self) -> None:
        """Remove every hook, restore every processor and the dispatch function (idempotent)."""
        while self._undos:
            self._undos.pop()()
        self.state.plan = None

    def __enter__(self) -> DiffusersHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def apply(transformer: torch.nn.Module, mesh: HybridMesh, *, backend: BackendName = "auto") -> DiffusersHandle:
    """Switch ``transformer`` (Wan 2.x, Flux, Qwen-Image) to exact hybrid Ulysses x ring attention.

    The switched transformer is called as before, with the full inputs on every rank of a context
    group, and returns the full output on every rank; inside, each rank holds ``1/C`` of the latent
    (and, in joint attention, text) tokens. Parameter gradients are each rank's share: summed over
    the context ranks (as ZeRO, FSDP2 over the world, or an all-reduce does) they are the
    one-process gradients. Raises ValueError, changing nothing, for what it cannot make exact.
    """
    family = family_of(transformer)
    family.check(transformer)
    _check_mesh(mesh)
    processors = _attention_processors(transformer, family, mesh)
    state = ForwardState()
    handle = DiffusersHandle(transformer, mesh, family, state)
    route = Route(mesh, backend, state)
    for processor in processors:
        handle._undos.append(_set_route(processor, route))
    for module_name in sorted({type(p).__module__ for p in processors}):
        handle._undos.append(install_router(sys.modules[module_name]))
    handle._undos += _install_hooks(transformer, family, mesh, state)
    if family.mask_arg is not None:  # Note [rows with different masks] in _rows
        handle._undos.append(install_row_split(transformer, family))
    return handle


def _check_mesh(mesh: HybridMesh) -> None:
    if mesh.tensor != 1:
        raise ValueError(f"the diffusers switch runs without tensor parallelism; got tensor={mesh.tensor}")
    if mesh.token_layout.uses_documents:
        raise ValueError(
            f"layout={mesh.layout!r} places tokens by documents a diffusion transformer does not have; "
            "use layout='contiguous' (balanced for non-causal attention) or 'zigzag'"
        )


def _attention_processors(transformer: torch.nn.Module, family: Family, mesh: HybridMesh) -> list[Any]:
    """Every attention module's processor, after checking each one is known and its heads split."""
    processors = []
    for name, module in transformer.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or not hasattr(module, "heads"):
            continue
        kind = type(processor).__name__
        if kind not in family.processors:
            raise ValueError(
                f"{name} has attention processor {kind}, which the switch does not know for "
                f"{family.model} (known: {', '.join(family.processors)}); restore the default processor"
            )
        if getattr(processor, "_parallel_config", None) is not None:
            raise ValueError(f"{name} already runs diffusers' own context parallelism; load the model without it")
        if module.heads % mesh.ulysses:
            raise ValueError(
                f"{name} has {module.heads} heads, which ulysses={mesh.ulysses} does not divide; "
                "choose a Ulysses degree that divides the head count"
            )
        processors.append(processor)
    if not processors:
        raise ValueError(f"{type(transformer).__name__} has no attention processor to switch")
    return processors


def _set_route(processor: Any, route: Route) -> Undo:
    had, old = "_parallel_config" in vars(processor), vars(processor).get("_parallel_config")
    processor._parallel_config = route

    def undo() -> None:
        if had:
            processor._parallel_config = old
        else:
            del processor._parallel_config

    return undo


def _install_hooks(transformer: torch.nn.Module, family: Family, mesh: HybridMesh, state: ForwardState) -> list[Undo]:
    """The plan-and-cut pre-hook on the transformer, the cut hooks below it, the output gather."""
    by_module: dict[str, list[Cut]] = defaultdict(list)
    for cut in family.cuts:
        by_module[cut.module].append(cut)
    top = by_module.pop("", [])

    def plan_and_cut(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        bound = bind(module, args, kwargs)
        if rows_differ(family, bound.arguments):  # the forward runs the rows one by one, each planned alone
            state.plan = None
            return None
        tokens = family.tokens(module, bound.arguments)
        state.plan = build_plan(mesh, {stream: tokens[stream] for stream in family.streams})
        _cut_inputs(bound.arguments, top, state, mesh)
        return bound.args, bound.kwargs

    hooks = [transformer.register_forward_pre_hook(plan_and_cut, with_kwargs=True)]
    for pattern, cuts in by_module.items():
        for module in _modules(transformer, pattern):
            hooks += _cut_hooks(module, cuts, state, mesh)

    def gather(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return gather_slots(output, state.current().stream("img"), mesh)  # [B, T_img, F]

    hooks.append(transformer.get_submodule(family.gather).register_forward_hook(gather))
    return [hook.remove for hook in hooks]


def _modules(transformer: torch.nn.Module, pattern: str) -> list[torch.nn.Module]:
    """The modules at ``pattern`` (a dotted path; ``a.*``: every direct child of ``a``)."""
    depth = pattern.count(".")
    found = [m for n, m in transformer.named_modules() if n.count(".") == depth and fnmatch.fnmatchcase(n, pattern)]
    if not found:
        raise ValueError(f"{type(transformer).__name__} has no module {pattern!r}; this diffusers version differs")
    return found


def _cut_hooks(module: torch.nn.Module, cuts: list[Cut], state: ForwardState, mesh: HybridMesh) -> list[Any]:
    inputs = [cut for cut in cuts if isinstance(cut.arg, str)]
    outputs = [cut for cut in cuts if isinstance(cut.arg, int)]
    hooks = []
    if inputs:

        def cut_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            bound = bind(module, args, kwargs)
            _cut_inputs(bound.arguments, inputs, state, mesh)
            return bound.args, bound.kwargs

        hooks.append(module.register_forward_pre_hook(cut_inputs, with_kwargs=True))
    if outputs:

        def cut_outputs(module: torch.nn.Module, args: tuple, output: Any) -> tuple:
            out = list(output)
            for cut in outputs:
                assert isinstance(cut.arg, int)
                if cut.applies(out[cut.arg]):
                    out[cut.arg] = take_slots(
                        out[cut.arg], state.current().stream(cut.stream), mesh.context_rank, cut.dim
                    )
            return type(output)(out) if isinstance(output, tuple) else tuple(out)

        hooks.append(module.register_forward_hook(cut_outputs))
    return hooks


def _cut_inputs(arguments: dict[str, Any], cuts: list[Cut], state: ForwardState, mesh: HybridMesh) -> None:
    """Replace each cut argument (when given) by this rank's slots of it, in place."""
    plan = state.current()
    for cut in cuts:
        assert isinstance(cut.arg, str)
        value = arguments.get(cut.arg)
        if cut.applies(value):
            arguments[cut.arg] = take_slots(value, plan.stream(cut.stream), mesh.context_rank, cut.dim)
