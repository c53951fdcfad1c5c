"""A switched Hugging Face model under ``torch.compile(model)`` (inductor) against the same model in eager.

Two families on 4 gloo ranks, fp32, three packed batches whose documents all differ:

- Llama at U2xR2 with the tiled MLP, loss ``sharded_cross_entropy`` of the logits (inductor);
- Qwen3 (per-layer sliding/full attention, GQA 4/2) at U1xR4 with ``kv_comm="allgather"``, loss the
  fused ``causal_lm_loss`` (the loss runs inside the compiled lm_head call), compiled with
  ``aot_eager``: the same capture, fake shapes and AOT autograd of hybridsp's operators, without
  inductor's C++ build (30 s of the suite).

The compiled loss and every parameter gradient must equal eager's (relative 1e-5; measured about
5e-7, inductor's own reordering), the model must compile to one graph with no recompilation across
the batches, and ``torch._dynamo.explain`` of a training step (model and loss) must count no more
graph breaks than the unswitched model's own step: none attributable to hybridsp.
"""

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.packs import packed_lm_batch

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5
SEQ, STEPS = 64, 3
RUNS = {  # name -> (family, init_mesh arguments, tiled MLP, fused loss, torch.compile backend)
    "llama-U2xR2-tiled": ("llama", dict(ulysses=2, ring=2), True, False, "inductor"),
    "qwen3-U1xR4-allgather-fused": ("qwen3", dict(ulysses=1, ring=4, kv_comm="allgather"), False, True, "aot_eager"),
}


def _switched(family: str, mesh, tiled: bool):
    from hybridsp import apply_tiled_mlp
    from hybridsp.integrations import transformers as hf
    from tests.helpers.families import build_family

    model = build_family(family)
    hf.apply(model, mesh)
    if tiled:
        apply_tiled_mlp(model, tile_tokens=8)
    return model


def _loss(model, local: dict, mesh, fused: bool):
    from hybridsp import sharded_cross_entropy
    from hybridsp.integrations import transformers as hf

    if fused:
        return hf.causal_lm_loss(model, local, mesh)
    out = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        hybridsp_documents=local["documents"],
        use_cache=False,
    )
    return sharded_cross_entropy(out.logits, local["shift_labels"], mesh)


def _explained_breaks(family: str, mesh, tiled: bool, fused: bool, local: dict, full: dict) -> tuple[int, int]:
    """(breaks of the switched step, breaks of the unswitched model's step on the full batch).

    The fused loss is explained as the function it is (``fused_cross_entropy`` of the last hidden
    states): ``causal_lm_loss`` swaps the lm_head's forward around the model call, which is for a
    compiled model to trace, not for a traced step."""
    from hybridsp import fused_cross_entropy
    from tests.helpers.families import build_family

    model = _switched(family, mesh, tiled)

    def step(local):
        if not fused:
            return _loss(model, local, mesh, fused)
        out = model.model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            hybridsp_documents=local["documents"],
            use_cache=False,
        )
        return fused_cross_entropy(out.last_hidden_state, model.lm_head.weight, local["shift_labels"], mesh)

    plain = build_family(family)
    torch._dynamo.reset()
    ours = torch._dynamo.explain(step)(local).graph_break_count
    torch._dynamo.reset()
    theirs = torch._dynamo.explain(lambda batch: plain(**batch, use_cache=False).loss)(full).graph_break_count
    return ours, theirs


def _run(family: str, mesh_args: dict, tiled: bool, fused: bool, backend: str) -> dict:
    from hybridsp import init_mesh, shard_batch
    from hybridsp.integrations import transformers as hf
    from tests.helpers.families import PAD

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    mesh = init_mesh(**mesh_args)
    model, eager = _switched(family, mesh, tiled), _switched(family, mesh, tiled)
    compiled = torch.compile(model, backend=backend)
    errors = []
    for step in range(STEPS):
        local = shard_batch(packed_lm_batch(step, SEQ), mesh, pad_token_id=PAD, sliding_window=hf.layout_window(model))
        losses = []
        for runner in (compiled, eager):
            runner.zero_grad(set_to_none=True)
            loss = _loss(runner, local, mesh, fused)
            loss.backward()
            losses.append(loss.detach())
        grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()) if q.grad is not None]
        errors.append(
            max(
                [((losses[0] - losses[1]).abs() / losses[1].abs()).item()]
                + [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in grads]
            )
        )
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    ours, theirs = _explained_breaks(family, mesh, tiled, fused, local, packed_lm_batch(0, SEQ))
    return {"errors": errors, "graphs": graphs, "recompiles": recompiles, "breaks": ours, "unswitched_breaks": theirs}


def _all_runs(rank, world):
    return {name: _run(*settings) for name, settings in RUNS.items()}


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_all_runs, 4, timeout=1200)


@pytest.mark.parametrize("name", RUNS)
def test_compiled_model_equals_eager(reports, name):
    for rank, report in enumerate(reports):
        errors = report[name]["errors"]
        assert max(errors) <= TOLERANCE, f"rank {rank}: compiled vs eager per batch {errors}"


@pytest.mark.parametrize("name", RUNS)
def test_one_graph_and_no_recompilation_for_packed_batches(reports, name):
    for report in reports:
        assert (report[name]["graphs"], report[name]["recompiles"]) == (1, 0), report[name]


@pytest.mark.parametrize("name", RUNS)
def test_no_graph_break_attributable_to_hybridsp(reports, name):
    for report in reports:
        assert report[name]["breaks"] <= report[name]["unswitched_breaks"], report[name]
