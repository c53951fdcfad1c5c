"""Every tested family, switched and sharded at U2xR2 over 4 gloo ranks, gives the logits, loss and every parameter
gradient of the same unmodified model run on the full sequence in one process (tests/helpers/families.py)."""

import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from hybridsp.testing import run_distributed
from tests.helpers.families import FAMILIES, build_family
from tests.helpers.reference import rel_err
from tests.helpers.switched_models import expected_of, make_batch, sharded

TOLERANCE = 1e-4
BATCHES = {"full": make_batch(64, (64, 64)), "padded": make_batch(61, (61, 40))}


def family_errors(name: str, mesh) -> dict[str, float]:
    """{what: relative error} of family ``name`` switched over ``mesh`` against its unmodified self."""
    model = build_family(name)
    expected = {}
    for key, batch in BATCHES.items():
        model.zero_grad(set_to_none=True)
        expected[key] = expected_of(model, batch)
    errors = {}
    with hf.apply(model, mesh, backend="torch"):
        for key, batch in BATCHES.items():
            logits, loss, grads, _ = sharded(model, mesh, batch)
            ref_logits, ref_loss, ref_grads = expected[key]
            real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()  # [B, S]
            errors[f"{key} logits"] = rel_err(logits[:, :real.shape[1]][real], ref_logits[real])
            errors[f"{key} loss"] = rel_err(loss, ref_loss)
            errors.update({f"{key} grad {n}": rel_err(g, ref_grads[n]) for n, g in grads.items()})
    return errors


def _check(rank, world, names, ulysses, ring):
    mesh = init_mesh(ulysses=ulysses, ring=ring)
    failures = []
    for name in names:
        try:
            errors = family_errors(name, mesh)
        except Exception as error:  # noqa: BLE001 - reported per family
            failures.append(f"{name}: {type(error).__name__}: {str(error)[:300]}")
            continue
        worst = max(errors, key=errors.get)
        if not errors[worst] <= TOLERANCE:
            failures.append(f"{name}: {worst} {errors[worst]:.2e}")
    assert not failures, "\n".join(failures)


def test_every_family_at_u2r2_equals_the_unmodified_model():
    run_distributed(_check, 4, list(FAMILIES), 2, 2, timeout=600)
