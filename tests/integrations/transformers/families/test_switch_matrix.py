"""Every tested family (tests/helpers/families.py), switched and sharded at U2xR2 over 4 gloo ranks, gives the logits,
loss and every parameter gradient of the same unmodified model in one process: on the full sequence, and on packed
documents against the model run per document; the families the table marks refused raise its reason."""

import pytest
import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from hybridsp.testing import run_distributed
from tests.helpers.families import REFUSED, SUPPORT, build_family, families_where
from tests.helpers.models.packed import packed_batch, per_document_reference
from tests.helpers.models.switched import expected_of, make_batch, sharded
from tests.helpers.references.attention import rel_err

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

TOLERANCE = 1e-4
BATCHES = {"full": make_batch(64, (64, 64)), "padded": make_batch(61, (61, 40))}
ROWS = ((20, 1, 3, 25, 15), (40, 24))  # a one-token and a three-token document
PACKED = packed_batch(ROWS, 64, seed=5)


def _errors(model, mesh, batch, expected, key: str) -> dict[str, float]:
    logits, loss, grads, _ = sharded(model, mesh, batch)
    ref_logits, ref_loss, ref_grads = expected
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()  # [B, S]
    errors = {
        f"{key} logits": rel_err(logits[:, : real.shape[1]][real], ref_logits[real]),
        f"{key} loss": rel_err(loss, ref_loss),
    }
    errors.update({f"{key} grad {n}": rel_err(g, ref_grads[n]) for n, g in grads.items()})
    return errors


def family_errors(name: str, mesh, packed: bool) -> dict[str, float]:
    """{what: relative error} of family ``name`` switched over ``mesh`` against its unmodified self."""
    model = build_family(name)
    expected = {}
    for key, batch in BATCHES.items():
        model.zero_grad(set_to_none=True)
        expected[key] = expected_of(model, batch)
    if packed:
        expected["packed"] = per_document_reference(model, PACKED, ROWS)
    errors = {}
    with hf.apply(model, mesh):  # "auto": the CPU fused kernel, the reference one where a call soft-caps
        for key in expected:
            errors.update(_errors(model, mesh, PACKED if key == "packed" else BATCHES[key], expected[key], key))
    return errors


def _refusal(name: str, mesh) -> str | None:
    """None when family ``name`` is refused with its table reason, else what happened instead."""
    reason = SUPPORT[name]["switch"][len(REFUSED) :]
    try:
        family_errors(name, mesh, packed=False)
    except ValueError as error:
        return None if reason in str(error) else f"{name}: refused for another reason: {error}"
    return f"{name}: ran although the table says {reason!r}"


def _check(rank, world, ulysses, ring):
    """The families compared (and their packed batches) and the refusals checked."""
    mesh = init_mesh(ulysses=ulysses, ring=ring)
    failures, compared = [], []
    for name in families_where("switch"):
        errors = family_errors(name, mesh, packed=name in families_where("packed"))
        worst = max(errors, key=errors.get)
        if not errors[worst] <= TOLERANCE:
            failures.append(f"{name}: {worst} {errors[worst]:.2e}")
        compared += [name] + [f"{name} packed"] * any(key.startswith("packed") for key in errors)
    for name in families_where("switch", REFUSED):
        failure = _refusal(name, mesh)
        failures += [failure] if failure else []
        compared.append(f"{name} refused")
    assert not failures, "\n".join(failures)
    return compared


def test_every_family_at_u2r2_equals_the_unmodified_model():
    switched, packed = families_where("switch"), families_where("packed")
    expected = [case for name in switched for case in [name] + [f"{name} packed"] * (name in packed)]
    expected += [f"{name} refused" for name in families_where("switch", REFUSED)]
    assert switched and packed, "the table marks no family for the switch or for packed documents: nothing to compare"
    for rank, compared in enumerate(run_distributed(_check, 4, 2, 2, timeout=600)):
        assert compared == expected, f"rank {rank} compared {compared}, not {expected}"
