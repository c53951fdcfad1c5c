"""One recorded forward and backward of a switched HF model: what :func:`hybridsp.verify_parity` compares.

The probe's tap (Note [probe tap] in :mod:`hybridsp.monitor`) is set on every bound attention
module's binding for one pass and restored after it; each switched call then hands it this rank's
q/k/v and output and the call's settings. The gradients come from ``torch.autograd.grad`` with
respect to those tensors and the logits only, so no parameter's ``.grad`` changes and no engine's
gradient hook fires: the probe can run between two training steps.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, cast

import torch
from torch import nn

from hybridsp.data._batch import shard_batch
from hybridsp.integrations.transformers._binding import BINDING_ATTR, NAME
from hybridsp.integrations.transformers._capabilities import layout_window
from hybridsp.losses._cross_entropy import sharded_cross_entropy
from hybridsp.mesh._hybrid_mesh import HybridMesh


@contextmanager
def tapped(model: nn.Module, tap) -> Iterator[int]:
    """Set ``tap`` on the binding of every switched attention module of ``model`` for the block; yields
    how many there are. The old bindings come back on exit, whatever happens."""
    bound = [(m, getattr(m, BINDING_ATTR)) for m in model.modules() if hasattr(m, BINDING_ATTR)]
    if not bound:
        raise ValueError(
            f"{type(model).__name__} has no attention module switched to {NAME!r}: call "
            f"hybridsp.integrations.transformers.apply(model, mesh) before verify_parity"
        )
    try:
        for module, binding in bound:
            setattr(module, BINDING_ATTR, dataclasses.replace(binding, tap=tap))
        yield len(bound)
    finally:
        for module, binding in bound:
            setattr(module, BINDING_ATTR, binding)


def probe_pass(model: nn.Module, mesh: HybridMesh, batch: Mapping[str, Any], pad_token_id: int = 0) -> dict:
    """Run ``model`` once forward and backward on this rank's shard of ``batch`` and record every attention call.

    Returns a dict: ``calls`` (per attention call in order: ``layer``, ``q``/``k``/``v`` [B, S/C, H|Hkv, D],
    ``out`` [B, S/C, H, Dv], their gradients ``dq``/``dk``/``dv``/``dout``, and ``softmax_scale``,
    ``sliding_window``, ``sinks``, ``softcap``, ``chunk``), ``logits`` [B, S/C, V] and ``dlogits``,
    ``shift_labels`` and ``position_ids`` [B, S/C], ``documents``, and ``loss`` (0-dim, the value
    :func:`hybridsp.sharded_cross_entropy` gave). Every context rank must call it.
    """
    local = shard_batch(batch, mesh, pad_token_id=pad_token_id, sliding_window=layout_window(model))
    calls: list[dict] = []
    seen: set[int] = set()

    def tap(module: nn.Module, q, k, v, out, **settings) -> None:
        if id(module) in seen:  # a recomputation under activation checkpointing: the first call is the pass's
            return
        seen.add(id(module))
        calls.append(dict(layer=getattr(module, "layer_idx", len(calls)), q=q, k=k, v=v, out=out, **settings))

    device = next(model.parameters()).device
    with tapped(model, tap), torch.enable_grad():
        logits = model(
            input_ids=local["input_ids"].to(device),
            position_ids=local["position_ids"].to(device),
            hybridsp_documents=local["documents"],
            use_cache=False,
        ).logits  # [B, S/C, V]
        shift_labels = cast(torch.Tensor, local["shift_labels"]).to(device)
        loss = sharded_cross_entropy(logits, shift_labels, mesh)
        tensors = [logits] + [c[name] for c in calls for name in ("q", "k", "v", "out")]
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
    for index, call in enumerate(calls):
        found = grads[1 + 4 * index : 5 + 4 * index]
        call.update({f"d{name}": g for name, g in zip(("q", "k", "v", "out"), found)})
        for name in ("q", "k", "v", "out"):
            call[name] = call[name].detach()
    return dict(
        calls=calls,
        logits=logits.detach(),
        dlogits=grads[0],
        shift_labels=shift_labels,
        position_ids=local["position_ids"].to(device),
        documents=local["documents"],
        loss=loss.detach(),
    )
