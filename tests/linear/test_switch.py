"""switch_linear_layers on one process (a 1 x 1 mesh without process groups): packed documents of Qwen3.5,
Qwen3-Next and Nemotron-H models of linear layers only against the unmodified model run per document (the
transformers fallbacks run straight across documents); the refusals before anything changes; undo; a cached
decode step refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridsp.integrations.transformers._linear_layers import MARK, linear_mixers, switch_linear_layers
from hybridsp.layout._documents import Documents
from tests.helpers.mesh import mesh_at
from tests.helpers.models.linear import packed_batch, per_document_reference, tiny_hybrid
from tests.helpers.references.attention import rel_err

ROWS = ((9, 1, 3, 11), (16, 8))  # B = 2, different documents per row
LINEAR_ONLY = {
    "qwen3_5": dict(num_hidden_layers=2, layer_types=["linear_attention", "linear_attention"]),
    "qwen3_next": dict(num_hidden_layers=1, layer_types=["linear_attention"], mlp_only_layers=[0]),
    "nemotron_h": dict(layers_block_type=["mamba", "mlp", "mamba"]),
}


def _switched_errors(family: str) -> dict:
    model = tiny_hybrid(family, **LINEAR_ONLY[family])
    batch = packed_batch(ROWS)
    ref_logits, _, ref_grads = per_document_reference(model, batch, ROWS)
    undo = switch_linear_layers(model, mesh_at(1, 1))
    model.zero_grad(set_to_none=True)
    documents = Documents(2, 24, tuple((0, *torch.tensor(r).cumsum(0).tolist()) for r in ROWS))
    logits = model(input_ids=batch["input_ids"], hybridsp_documents=documents, use_cache=False).logits
    inside = torch.ones_like(batch["input_ids"], dtype=torch.bool)
    for b, lengths in enumerate(ROWS):
        inside[b, torch.tensor(lengths).cumsum(0) - 1] = False  # no target across a document end
    targets = batch["input_ids"].roll(-1, dims=1)
    torch.nn.functional.cross_entropy(logits[inside], targets[inside]).backward()
    errors = {"logits": rel_err(logits.detach(), ref_logits)}
    errors.update({n: rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.grad is not None})
    undo()
    return errors


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "nemotron_h"])
def test_packed_documents_on_one_process(family):
    errors = _switched_errors(family)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"{family}: worst {worst} {errors[worst]:.2e}"


def test_undo_restores_the_class_forward():
    model = tiny_hybrid("qwen3_5", **LINEAR_ONLY["qwen3_5"])
    undo = switch_linear_layers(model, mesh_at(1, 1))
    mixers = [m for m, _ in linear_mixers(model)]
    assert len(mixers) == 2 and all("forward" in m.__dict__ and hasattr(m, MARK) for m in mixers)
    undo()
    undo()  # idempotent
    assert not any("forward" in m.__dict__ or hasattr(m, MARK) for m in mixers)


def test_refusals_change_nothing():
    model = tiny_hybrid("qwen3_5", **LINEAR_ONLY["qwen3_5"])  # 2 key heads
    with pytest.raises(ValueError, match="2 key heads, not divisible by the Ulysses degree 4"):
        switch_linear_layers(model, mesh_at(4, 1))
    assert not any("forward" in m.__dict__ for m in model.modules())
    undo = switch_linear_layers(model, mesh_at(1, 1))
    with pytest.raises(ValueError, match="already switched"):
        switch_linear_layers(model, mesh_at(1, 1))
    undo()

    class UnknownRecurrence(nn.Module):
        def __init__(self):
            super().__init__()
            self.A_log = nn.Parameter(torch.zeros(2))

    model.model.layers[0].extra = UnknownRecurrence()  # apply refuses it (tests/integrations/.../test_token_mixers.py)
    from hybridsp.integrations import transformers as hf

    with pytest.raises(ValueError, match=r"UnknownRecurrence in layers 0 \(its own parameter 'A_log'"):
        hf.apply(model, mesh_at(1, 1))
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert switch_linear_layers(nn.Linear(2, 2), mesh_at(1, 1)) is None


def test_a_cached_decode_step_is_refused():
    model = tiny_hybrid("qwen3_5")  # linear, attention, linear
    ids = packed_batch(((12,),))["input_ids"]
    cache = model(input_ids=ids, use_cache=True).cache
    switch_linear_layers(model, mesh_at(1, 1))
    with pytest.raises(ValueError, match="generation and cached decoding are not supported"):
        model(input_ids=ids[:, -1:], cache=cache, use_cache=True)


def test_left_padded_generation_is_refused_before_any_collective():
    from hybridsp.integrations import transformers as hf

    model = tiny_hybrid("qwen3_5")
    mesh = mesh_at(1, 1)  # no process groups: a collective would fail
    ids = packed_batch(((8,), (8,)))["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1 left-padded by 3
    with hf.apply(model, mesh):
        with pytest.raises(ValueError, match=r"without left padding \(got \[0, 3\] pad tokens"):
            hf.generate(model, ids, mesh=mesh, max_new_tokens=2, attention_mask=mask)
        with pytest.raises(ValueError, match="without left padding"):
            hf.prefill(model, ids, mesh=mesh, attention_mask=mask)


def test_attention_heads_are_counted_without_the_output_gate():
    """Qwen3.5's q_proj holds 2 H heads' rows (queries and their gate): 2 heads at U = 4 are refused, although
    the 4 linear key heads would split."""
    from hybridsp.integrations import transformers as hf

    model = tiny_hybrid(
        "qwen3_5", num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=4, linear_num_value_heads=4
    )
    with pytest.raises(ValueError, match="2 query heads are not divisible by the Ulysses degree 4"):
        hf.apply(model, mesh_at(4, 1))
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_second_prefill_into_a_generation_cache_is_refused():
    """A call into a generation cache whose layer already holds the prompt state, without a decode step (a decoder
    layer that dropped the keyword arguments), would restart the state: refused."""
    from hybridsp.integrations.transformers._hybrid_cache import HybridCache
    from hybridsp.linear_attention._decode import LinearStates

    model = tiny_hybrid("qwen3_5")
    switch_linear_layers(model, mesh_at(1, 1))
    mixer = next(m for m, _ in linear_mixers(model))
    cache = HybridCache.__new__(HybridCache)  # only its linear_states is read here
    cache.linear_states = LinearStates(4, torch.arange(4))
    cache.linear_states.layers[mixer.layer_idx] = (None, None)
    with pytest.raises(ValueError, match="already holds this layer's prompt state"):
        mixer(torch.randn(1, 1, 64), cache=cache)
