"""Donated q/k/v (``donate_inputs``, Note [donated q/k/v] in hybridsp.memory._qkv_donation): the
head-chunked backward without Ulysses writes dq, dk, dv into q, k, v's storage.

Core: with and without donation the output and the gradients of the tensors q, k, v were made from are
bitwise equal and match float64 attention; the gradients autograd hands on *are* q, k, v's storage
exactly where donated (q, k, v made as the model makes them: non-leaf, HF's heads-first layout seen
through a transpose; GQA, odd groups, Dv != D, fp64, B = 2); ``k is v`` donates neither; U > 1 never
donates; a later autograd use of a donated tensor raises. Switch: a tiny Llama under non-reentrant,
reentrant and split checkpointing (with lean RoPE too) donates in every layer and matches the unmodified one-process model;
without checkpointing nothing is donated, nor for a module whose forward was not read (DiffLlama reads
q, k, v again after the call).
"""

from __future__ import annotations

import pytest
import torch

from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
from hybridsp.attention import _head_chunks
from hybridsp.memory._qkv_donation import hands_qkv_to_attention_alone, in_checkpointed_region
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, reference_with_grads, rel_err

SEQ = 24


def _attend(mesh, full, chunks, donate, shared_kv=False):
    """(out, grads of the leaves q, k, v were made from, {name: was the gradient handed on q/k/v's storage})."""
    q_hf, k_hf, v_hf, dout = (shard_sequence(t, mesh).transpose(1, 2).clone() for t in full)  # [B, H, L, D]
    leaves = [t.requires_grad_() for t in (q_hf, k_hf, v_hf)]
    q, k, v = ((t * 1.0).transpose(1, 2) for t in leaves)  # [B, L, H, D] views of fresh temporaries
    if shared_kv:
        v = k
    handed = {}
    for name, tensor in zip("qkv", (q, k, v)):
        tensor.register_hook(
            lambda grad, name=name, tensor=tensor: handed.__setitem__(name, _same_storage(grad, tensor))
        )
    out = hybrid_attn_func(q, k, v, mesh=mesh, head_chunks=chunks, donate_inputs=donate)
    out.backward(dout.transpose(1, 2))
    grads = [leaf.grad.transpose(1, 2) for leaf in leaves if leaf.grad is not None]  # [B, L, H, D]; v unused if shared
    return [out.detach(), *grads], handed


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


CASES = [  # (ulysses, ring, heads, kv_heads, head dims (D, Dv), groups, dtype, batch)
    (1, 2, 8, 4, (16, 16), 2, torch.float32, 2),
    (1, 2, 6, 3, (12, 8), 3, torch.float64, 1),
    (2, 1, 8, 4, (16, 16), 2, torch.float32, 1),
]


def _core(rank, world):
    answers = []
    for ulysses, ring, heads, kv_heads, (d, dv), groups, dtype, batch in CASES:
        mesh = init_mesh(ulysses=ulysses, ring=ring)
        full = random_qkv(batch, SEQ, heads, kv_heads, d, v_head_dim=dv, seed=heads, dtype=dtype)
        kept, kept_handed = _attend(mesh, full, groups, donate=False)
        donated, donated_handed = _attend(mesh, full, groups, donate=True)
        expected = [shard_sequence(e, mesh) for e in reference_with_grads(*full, causal=True)]
        answers.append(
            {
                "bitwise": all(torch.equal(a, b) for a, b in zip(donated, kept)),
                "error": max(rel_err(g, e) for g, e in zip(donated, expected)),
                "kept_handed": kept_handed,
                "donated_handed": donated_handed,
            }
        )
    mesh = init_mesh(ulysses=1, ring=2)
    mqa = random_qkv(1, SEQ, 4, 2, 8, seed=7)
    shared, shared_handed = _attend(mesh, mqa, 2, donate=True, shared_kv=True)
    plain, _ = _attend(mesh, mqa, 2, donate=False, shared_kv=True)
    answers.append({"bitwise": all(torch.equal(a, b) for a, b in zip(shared, plain)), "handed": shared_handed})
    return answers


@pytest.mark.distributed
def test_donated_gradients_are_bitwise_the_kept_ones_and_live_in_q_k_v():
    for answers in run_distributed(_core, 2):
        *cases, shared = answers
        for (ulysses, *_), answer in zip(CASES, cases):
            assert answer["bitwise"], answer
            assert answer["error"] < 1e-5, answer
            assert answer["kept_handed"] == {"q": False, "k": False, "v": False}, answer
            donates = ulysses == 1  # U > 1 keeps the ring-slot buffers, not q, k, v: nothing to donate
            assert answer["donated_handed"] == {"q": donates, "k": donates, "v": donates}, answer
        assert shared["bitwise"], shared
        assert not shared["handed"]["k"], shared  # k is v: their storage is shared, so neither is donated


def _later_use(rank, world):
    """A donated q that another autograd node saved: its backward must refuse the overwritten q."""
    mesh = init_mesh(ulysses=1, ring=2)
    q, k, v, dout = (shard_sequence(t, mesh).clone() for t in random_qkv(1, SEQ, 4, 2, 8, seed=1))
    q_leaf = q.requires_grad_()
    scale = torch.ones(1, requires_grad=True)
    q = q_leaf * 1.0
    watched = q * scale  # saves q for scale's gradient; made first, so its backward runs after the attention's
    out = hybrid_attn_func(q, k, v, mesh=mesh, head_chunks=2, donate_inputs=True)
    try:
        torch.autograd.backward([watched.sum(), out], [None, dout])
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.distributed
def test_a_later_autograd_use_of_a_donated_tensor_raises():
    for message in run_distributed(_later_use, 2):
        assert message is not None and "modified by an inplace operation" in message


@pytest.mark.fast
def test_checkpointed_region_detection():
    from torch.utils.checkpoint import checkpoint

    seen = []

    def region(x):
        seen.append(in_checkpointed_region())
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    region(x)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    checkpoint(region, x, use_reentrant=True).sum().backward()
    with torch.autograd.graph.save_on_cpu():
        region(x)
    # plain; non-reentrant forward and its recompute; reentrant forward (no grad) and its recompute; other hooks
    assert seen == [False, True, True, False, True, False]


@pytest.mark.fast
def test_only_the_forwards_read_hand_qkv_alone():
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention
    from transformers.models.mixtral.modeling_mixtral import MixtralAttention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    assert hands_qkv_to_attention_alone(MixtralAttention) and hands_qkv_to_attention_alone(Qwen3Attention)
    assert not hands_qkv_to_attention_alone(DiffLlamaAttention)  # reads q, k, v again after the call
    assert not hands_qkv_to_attention_alone(Gemma2Attention)  # a forward not read for donation


@pytest.mark.fast
def test_no_donation_while_recording_or_with_an_instance_forward():
    from torch.utils.checkpoint import checkpoint

    from hybridsp.memory._qkv_donation import may_donate_qkv
    from tests.helpers.models.switched import build

    attention = build("llama").model.layers[0].self_attn
    answers = []

    def region(x):
        answers.append((may_donate_qkv(attention, recording=False), may_donate_qkv(attention, recording=True)))
        return x.sin()

    x = torch.ones(2, requires_grad=True)
    checkpoint(region, x, use_reentrant=False)
    attention.forward = attention.forward  # an instance-level forward: not the one read
    checkpoint(region, x, use_reentrant=False)
    assert answers == [(True, False), (False, False)]


def _switched(rank, world, family, mode):
    """(largest error of loss and gradients against the unmodified model, q/k/v donated per backward call)."""
    import hybridsp
    from hybridsp.integrations import transformers as hf
    from tests.helpers.models.switched import build, expected_of, make_batch, sharded

    mesh = init_mesh(ulysses=1, ring=2)
    model = build(family).train()
    batch = make_batch(32, (32, 32))
    _, loss, grads = expected_of(model, batch)
    if mode != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    split = hybridsp.apply_split_checkpointing(model) if mode.startswith("split") else None
    rope = hybridsp.apply_lean_rope(model) if mode.endswith("+rope") else None
    hf.apply(model, mesh, backend="torch", head_chunks=2)
    counts = []
    original = _head_chunks._donated

    def counting(*args):
        donated = original(*args)
        counts.append(sum(t is not None for t in donated))
        return donated

    _head_chunks._donated = counting
    try:
        _, got_loss, got_grads, _ = sharded(model, mesh, batch)
    finally:
        _head_chunks._donated = original
        if split is not None:
            split.undo()
        if rope is not None:
            rope.undo()
    errors = [rel_err(got_loss, loss)] + [rel_err(got_grads[name], grads[name]) for name in grads]
    return max(errors), counts


@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["split", "split+rope"])  # lean RoPE's forward hands q, k, v on alone too
def test_switch_donates_under_split_checkpointing_and_matches_the_model(mode):
    for error, counts in run_distributed(_switched, 2, "llama", mode):
        assert error < 1e-4, error
        assert counts == [3, 3], counts  # both layers' q, k, v


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.distributed
@pytest.mark.parametrize(
    "family, mode, donated",
    [("llama", "non-reentrant", 3), ("llama", "reentrant", 3), ("llama", "none", 0), ("qwen3", "non-reentrant", 3)],
)
def test_switch_donates_only_where_it_can_tell(family, mode, donated):
    for error, counts in run_distributed(_switched, 2, family, mode):
        assert error < 1e-4, error
        assert counts == [donated, donated], counts
