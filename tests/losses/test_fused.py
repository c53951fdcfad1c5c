"""fused_cross_entropy against sharded_cross_entropy on materialised logits and float64 math.

Value and gradients (hidden [B, S_local, h], weight [V, h]) on gloo ranks for several meshes,
chunk sizes that do and do not divide the local tokens, ignored labels, a shard with no valid
token, an all-ignored batch, tied weights (the same matrix embeds the tokens and projects
them), fp32 (1e-5) and bf16 (flash-attn's rule: error vs float64 at most 2x the logits path's).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridsp import fused_cross_entropy, gather_sequence, init_mesh, shard_sequence, sharded_cross_entropy
from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
from tests.helpers.references.attention import rel_err

BATCH, SEQ, HIDDEN, VOCAB = 2, 32, 16, 40
TOLERANCE = 1e-5
CHUNKS = (None, 3, 8)  # default (one chunk here), a non-divisor, a divisor of S_local


def _problem(seed, ignored, tied=False):
    """ids [B, S], embedding/head [V, h], a mixing matrix [h, h], labels [B, S] (ignored -> -100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) / 2
    mix = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen).masked_fill(ignored, -100)
    return {"ids": ids, "weight": weight, "mix": mix, "hidden": hidden, "labels": labels, "tied": tied}


def _hidden_of(p, weight, hidden):
    """The tied case embeds the ids with ``weight`` itself: hidden = tanh(weight[ids] @ mix) + hidden."""
    return torch.tanh(weight[p["ids"]] @ p["mix"]) + hidden if p["tied"] else hidden


def _reference64(p):
    """(loss, d weight, d hidden) of the unsharded mean CE in float64."""
    weight = p["weight"].double().requires_grad_()
    hidden = p["hidden"].double().requires_grad_()
    h = _hidden_of({**p, "mix": p["mix"].double()}, weight, hidden)
    loss = F.cross_entropy((h @ weight.t()).flatten(0, 1), p["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), weight.grad, hidden.grad


def _run(mesh, p, dtype, fused, chunk=None):
    """(loss, d weight summed over the context group, gathered d hidden) of this rank's shard."""
    weight = p["weight"].to(dtype, copy=True).requires_grad_()
    hidden = shard_sequence(p["hidden"], mesh).to(dtype, copy=True).requires_grad_()
    local = {**p, "ids": shard_sequence(p["ids"], mesh), "mix": p["mix"].to(dtype)}
    h = _hidden_of(local, weight, hidden)
    labels = shard_sequence(p["labels"], mesh)
    if fused:
        loss = fused_cross_entropy(h, weight, labels, mesh, chunk_size=chunk)
    else:
        loss = sharded_cross_entropy(h @ weight.t(), labels, mesh)
    loss.backward()
    grad_weight = weight.grad.float()
    if mesh.context > 1:
        dist.all_reduce(grad_weight, group=mesh.context_group)
    return loss.detach(), grad_weight, gather_sequence(hidden.grad.float(), mesh)


def _cases():
    tail = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    tail[:, 20:] = True  # empties the zigzag shards that hold the sequence's end
    some = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(1)) < 0.3
    return {
        "none": torch.zeros(BATCH, SEQ, dtype=torch.bool),
        "random": some,
        "tail": tail,
        "all": torch.ones(BATCH, SEQ, dtype=torch.bool),
    }


def _check(rank, world, meshes):
    failures, checked = [], 0
    for ulysses, ring in meshes:
        mesh = init_mesh(ulysses=ulysses, ring=ring)
        for name, ignored in _cases().items():
            for tied in (False, True):
                p = _problem(10 + mesh.dp_rank, ignored, tied)
                tag = f"U={ulysses} R={ring} {name} tied={tied}"
                failures += _compare_fp32(mesh, p, name, tag)
                if name in ("random", "tail"):
                    failures += _compare_bf16(mesh, p, tag)
                checked += 1
    assert not failures, "\n".join(failures)
    return checked


def _compare_fp32(mesh, p, name, tag):
    failures = []
    logits_path = _run(mesh, p, torch.float32, fused=False)
    exact = _reference64(p)
    for chunk in CHUNKS:
        fused = _run(mesh, p, torch.float32, fused=True, chunk=chunk)
        if not all(torch.isfinite(t).all() for t in fused):
            failures.append(f"{tag} chunk={chunk}: not finite")
            continue
        if name == "all":  # nothing to learn from: exactly 0 everywhere, like the logits path
            errors = [t.abs().max().item() for t in fused]
        else:
            errors = [rel_err(a, e) for a, e in zip(fused, logits_path)]
            errors += [rel_err(a, e) for a, e in zip(fused, exact)]
        if max(errors) > TOLERANCE:
            failures.append(f"{tag} chunk={chunk}: {errors}")
    return failures


def _compare_bf16(mesh, p, tag):
    exact = _reference64(p)
    logits_errors = [rel_err(a, e) for a, e in zip(_run(mesh, p, torch.bfloat16, fused=False), exact)]
    fused_errors = [rel_err(a, e) for a, e in zip(_run(mesh, p, torch.bfloat16, fused=True, chunk=5), exact)]
    bad = [(f, e) for f, e in zip(fused_errors, logits_errors) if f > 2 * e + 1e-3]
    return [f"{tag} bf16: fused {fused_errors} vs logits path {logits_errors}"] if bad else []


@pytest.mark.distributed
def test_fused_loss_and_gradients_equal_the_logits_path():
    # world 4: U2 x R2 (DP 1) and U2 (DP 2, each replica its own batch)
    checked = run_distributed(_check, 4, [(2, 2), (2, 1)])
    assert all(count == 16 for count in checked)


def test_single_rank_fp32_and_bf16_and_no_grad():
    mesh = mesh_at(1, 1)
    p = _problem(3, _cases()["random"])
    exact = _reference64(p)
    for chunk in CHUNKS:
        errors = [rel_err(a, e) for a, e in zip(_run(mesh, p, torch.float32, True, chunk), exact)]
        assert max(errors) <= TOLERANCE, (chunk, errors)
    with torch.no_grad():
        loss = fused_cross_entropy(p["hidden"], p["weight"], p["labels"], mesh, chunk_size=7)
    assert rel_err(loss, exact[0]) <= TOLERANCE and loss.grad_fn is None


def test_the_logits_are_never_materialised():
    """Peak of torch's allocations inside the call (fp32): one chunk's logits (made into their
    gradient in place), the fp32 weight-gradient accumulator and the hidden gradient, c V 4 + V h 4
    + T h 4 (the planner's fused-loss term), within 5% (small [c] vectors); for an explicit chunk and
    for the default one, ceil(T h / V) rows."""
    from torch.profiler import ProfilerActivity, profile

    from hybridsp._formulas import default_chunk_size

    tokens, vocab, hidden_size = 2048, 4096, 32
    assert default_chunk_size(vocab, tokens, hidden_size) == 16
    for chunk in (128, None):
        hidden = torch.randn(1, tokens, hidden_size, requires_grad=True)
        weight = torch.randn(vocab, hidden_size, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fused_cross_entropy(hidden, weight, labels, mesh_at(1, 1), chunk_size=chunk).backward()
        live = peak = 0
        for event in sorted(
            (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
        ):
            live += event.nbytes()
            peak = max(peak, live)
        rows = chunk or default_chunk_size(vocab, tokens, hidden_size)
        formula = rows * vocab * 4 + vocab * hidden_size * 4 + tokens * hidden_size * 4
        assert formula <= peak <= 1.05 * formula < tokens * vocab * 4 / 4, (chunk, peak, formula)


def test_bad_inputs_raise_value_errors():
    mesh = mesh_at(1, 1)
    hidden, weight, labels = torch.zeros(2, 8, 4), torch.zeros(10, 4), torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden \(2, 8, 4\) and shift_labels \(2, 7\)"):
        fused_cross_entropy(hidden, weight, labels[:, :7], mesh)
    with pytest.raises(ValueError, match=r"weight \(4, 10\) must be \[V, h\] with h = .* 4"):
        fused_cross_entropy(hidden, weight.t(), labels, mesh)
    with pytest.raises(ValueError, match="share a dtype"):
        fused_cross_entropy(hidden, weight.double(), labels, mesh)
    with pytest.raises(ValueError, match=r"16 target id\(s\) in shift_labels lie outside the vocabulary \[0, 10\)"):
        fused_cross_entropy(hidden, weight, labels.fill_(10), mesh)
    with pytest.raises(ValueError, match="chunk_size must be a positive"):
        fused_cross_entropy(hidden, weight, labels.fill_(1), mesh, chunk_size=0)


def test_a_second_backward_is_refused():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss = fused_cross_entropy(hidden, weight, torch.randint(0, 10, (1, 4)), mesh_at(1, 1))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
