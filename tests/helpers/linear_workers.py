"""Workers of the linear-layer tests: a switched hybrid model on a U x R mesh against the unmodified
model on one process (per document), forward and every parameter gradient."""

from __future__ import annotations

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from tests.helpers.linear_models import packed_batch, per_document_reference, tiny_hybrid
from tests.helpers.reference import rel_err
from tests.helpers.switched_models import sharded


def model_errors(family: str, ulysses: int, ring: int, rows, layout: str = "zigzag", linear: bool = True) -> dict:
    """{what: relative error} of logits, loss and every parameter gradient (summed over the context
    group) of ``family`` switched onto a ``ulysses x ring`` mesh, against the per-document reference.
    ``linear=False``: the linear layers are switched back right away (the unmodified mixers run per shard)."""
    model = tiny_hybrid(family)
    batch = packed_batch(rows)
    ref_logits, ref_loss, ref_grads = per_document_reference(model, batch, rows)
    mesh = init_mesh(ulysses=ulysses, ring=ring, layout=layout)
    with hf.apply(model, mesh) as handle:
        if not linear:
            handle.undo_linear()
        logits, loss, grads, _ = sharded(model, mesh, batch)
    errors = {"logits": rel_err(logits, ref_logits), "loss": rel_err(loss, ref_loss)}
    errors.update({f"grad {n}": rel_err(g, ref_grads[n]) if n in ref_grads else float("inf") for n, g in grads.items()})
    return errors


def cases_worker(rank: int, world: int, cases) -> dict:
    """Each case ``(name, family, ulysses, ring, rows, layout, linear)`` -> its worst error and what it was."""
    found = {}
    for name, family, ulysses, ring, rows, layout, linear in cases:
        errors = model_errors(family, ulysses, ring, rows, layout, linear)
        worst = max(errors, key=errors.get)
        found[name] = (errors[worst], worst)
    return found
