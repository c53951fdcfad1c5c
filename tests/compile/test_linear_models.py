"""A switched hybrid linear-attention model (Qwen3.5: Gated DeltaNet, attention, Gated DeltaNet) under
``torch.compile`` compiles once for every packing of a length (issue 47), and equals eager.

Three packed batches of one length with different documents, at U1xR2 on 2 gloo ranks (``aot_eager``: the
same capture and AOT autograd as inductor without its C++ build). The mixers run eager inside the compiled
model (Note [mixers under compile] in hybridsp/integrations/transformers/_token_mixers.py): the number of graphs
after the first batch must not grow, and each step's loss and every parameter gradient must equal the same
switched model run eagerly.
"""

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.packs import packed_lm_batch

pytestmark = [pytest.mark.distributed, pytest.mark.integration]

SEQ, STEPS, TOLERANCE = 32, 3, 1e-5


def _step(call, mesh, batch) -> tuple[float, dict]:
    """(loss, {name: gradient}) of one step of ``model`` (compiled or not) on this rank's shard."""
    from hybridsp import shard_batch, sharded_cross_entropy

    model = getattr(call, "_orig_mod", call)  # the compiled wrapper's parameters carry a prefix
    model.zero_grad(set_to_none=True)
    local = shard_batch(batch, mesh)
    out = call(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        hybridsp_documents=local["documents"],
        use_cache=False,
    )
    loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compiled_vs_eager(rank: int, world: int) -> dict:
    from hybridsp import init_mesh
    from hybridsp.integrations import transformers as hf
    from tests.helpers.models.linear import tiny_hybrid

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    mesh = init_mesh(1, world)
    eager, compiled_model = tiny_hybrid("qwen3_5"), tiny_hybrid("qwen3_5")
    hf.apply(eager, mesh)
    hf.apply(compiled_model, mesh)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    graphs, errors = [], []
    for step in range(STEPS):
        batch = packed_lm_batch(step, SEQ)
        loss, grads = _step(compiled, mesh, batch)
        graphs.append(counters["stats"]["unique_graphs"])
        expected_loss, expected = _step(eager, mesh, batch)
        errors.append(abs(loss - expected_loss) / abs(expected_loss))
        errors += [float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in expected.items()]
    return {"graphs": graphs, "error": max(errors)}


def test_a_compiled_qwen3_5_compiles_once_for_every_packing():
    for report in run_distributed(_compiled_vs_eager, 2, timeout=600):
        assert report["error"] < TOLERANCE, report
        assert report["graphs"][0] == report["graphs"][-1], report  # no new graph for a new packing
