"""transformers models on packed documents and sliding windows, sharded over gloo ranks, against the
unmodified model: run on each document separately for packed rows, on the full sequence (its own
sliding-window masks) for windowed layers. Logits, loss and every parameter gradient within 1e-4."""

from __future__ import annotations

import pytest
import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from hybridsp.testing import run_distributed
from tests.helpers.models.packed import packed_batch, per_document_reference
from tests.helpers.models.switched import build, sharded
from tests.helpers.references.attention import rel_err

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
SEQ = 64
ROW_A = (20, 1, 3, 25, 15)  # a length-1 and a length-3 document
ROW_B = (40, 24)
WINDOWED = {  # family -> config overrides giving sliding-window layers
    "mistral": dict(sliding_window=6),  # smaller than a local shard (S / C = 16)
    "qwen2": dict(use_sliding_window=True, sliding_window=10, max_window_layers=1),  # full, then sliding
    "qwen3": dict(use_sliding_window=True, sliding_window=7, layer_types=["sliding_attention", "full_attention"]),
}


def full_reference(model, batch):
    """(logits, loss, grads) of the unmodified model on the full unpacked sequence."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _errors(model, mesh, batch, expected):
    logits, loss, grads, _ = sharded(model, mesh, batch)
    ref_logits, ref_loss, ref_grads = expected
    errors = {"logits": rel_err(logits[:, :SEQ], ref_logits), "loss": rel_err(loss, ref_loss)}
    errors.update({f"grad {n}": rel_err(g, ref_grads[n]) for n, g in grads.items()})
    return errors


def _cases():
    """(name, family, overrides, batch, rows or None for an unpacked batch)."""
    unpacked = {k: v for k, v in packed_batch(((SEQ,), (SEQ,)), SEQ, seed=1).items() if k != "position_ids"}
    one, two = ((ROW_A,), (ROW_A, ROW_B))
    return [
        ("llama packed B=1", "llama", {}, packed_batch(one, SEQ), one),
        ("llama packed B=2", "llama", {}, packed_batch(two, SEQ), two),
        ("mistral window 6", "mistral", WINDOWED["mistral"], unpacked, None),
        ("mistral window 6 packed", "mistral", WINDOWED["mistral"], packed_batch(two, SEQ, seed=2), two),
        ("qwen2 full+sliding", "qwen2", WINDOWED["qwen2"], unpacked, None),
        ("qwen2 full+sliding packed", "qwen2", WINDOWED["qwen2"], packed_batch(two, SEQ, seed=3), two),
        ("qwen3 sliding+full", "qwen3", WINDOWED["qwen3"], unpacked, None),
    ]


def _check(rank, world, meshes, names, layout="zigzag"):
    failures = []
    for ulysses, ring in meshes:
        mesh = init_mesh(ulysses=ulysses, ring=ring, layout=layout)
        for name, family, overrides, batch, rows in _cases():
            if name not in names:
                continue
            model = build(family, **overrides)
            expected = per_document_reference(model, batch, rows) if rows else full_reference(model, batch)
            with hf.apply(model, mesh, backend="torch"):
                errors = _errors(model, mesh, batch, expected)
            worst = max(errors, key=errors.get)
            if errors[worst] > TOLERANCE:
                failures.append(f"U={ulysses} R={ring} {name}: {worst} {errors[worst]:.2e}")
    assert not failures, "\n".join(failures)


ALL = [case[0] for case in _cases()]


@pytest.mark.distributed
def test_world4_packed_and_windowed_models_equal_the_unmodified_model():
    run_distributed(_check, 4, [(2, 2)], ALL, timeout=400)


@pytest.mark.distributed
def test_world4_balanced_layout_packed_models_equal_the_unmodified_model():
    packed = [name for name in ALL if "packed" in name]
    run_distributed(_check, 4, [(1, 4)], packed, "balanced", timeout=400)


@pytest.mark.distributed
@pytest.mark.slow
def test_world4_ring_only_and_world8():
    run_distributed(_check, 4, [(1, 4), (4, 1)], ALL, timeout=600)
    run_distributed(_check, 8, [(2, 4), (1, 8)], ALL, timeout=600)
    run_distributed(_check, 4, [(2, 2)], ALL, "balanced", timeout=600)
    run_distributed(_check, 8, [(2, 4)], ALL, "balanced", timeout=600)


# ---- one process: the references really exercise what they claim -----------------------------


def test_windowed_references_differ_from_full_attention():
    for family, overrides in WINDOWED.items():
        batch = packed_batch(((SEQ,),), SEQ, seed=1)
        windowed = build(family, **overrides)(input_ids=batch["input_ids"], use_cache=False).logits
        full = build(family)(input_ids=batch["input_ids"], use_cache=False).logits
        assert rel_err(windowed, full) > 1e-3, family


def test_packed_kwargs_forms_and_single_rank_packing():
    """C = 1: the hook derives documents from position_ids; cu_seq_lens_q given by hand agrees."""
    from tests.helpers.mesh import mesh_at

    rows = (ROW_A, ROW_B)
    batch = packed_batch(rows, SEQ)
    model = build("llama")
    expected, _, _ = per_document_reference(model, batch, rows)
    with hf.apply(model, mesh_at(1, 1), backend="torch"):
        derived = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        flat = torch.tensor([0, 20, 21, 24, 49, 64, 104, 128])  # transformers' flattened form over B x S
        given = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            use_cache=False,
            cu_seq_lens_q=flat,
            cu_seq_lens_k=flat,
        ).logits
        with pytest.raises(ValueError, match="B x S = 2 x 64 = 128"):
            model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                use_cache=False,
                cu_seq_lens_q=flat[:-1],
                cu_seq_lens_k=flat[:-1],
            )
    assert rel_err(derived.detach(), expected) < TOLERANCE and rel_err(given.detach(), expected) < TOLERANCE
