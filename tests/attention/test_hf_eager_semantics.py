"""Sinks, soft-capping and MLA's head dims mean what the models mean: hybrid attention at U2 x R2
against transformers' own eager attention functions of GPT-OSS (``module.sinks``), Gemma 2
(``softcap``) and DeepSeek-V3 (v narrower than q/k), run on one process in float64 on the whole
sequence; forward and the gradients of q, k, v and the sinks (summed over the context ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hybridsp import hybrid_attn_func, init_mesh, ring_attention, shard_sequence
from hybridsp.testing import run_distributed
from tests.helpers.references.attention import random_qkv, rel_err

HEADS, KV_HEADS, SEQ = 4, 2, 32


def _eager(model: str):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gpt_oss import modeling_gpt_oss

    return {"gpt_oss": modeling_gpt_oss, "gemma2": modeling_gemma2, "deepseek_v3": modeling_deepseek_v3}[model]


def _hf_reference(model, full, scaling, sinks=None, softcap=None):
    """(out [B, S, H, Dv], dq, dk, dv, dsinks) of the model's eager attention in float64, causal mask added."""
    q, k, v = (t.detach().double().requires_grad_() for t in full[:3])
    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, training=False, head_dim=q.shape[-1])
    extra = {}
    if sinks is not None:
        module.sinks = sinks.detach().double().requires_grad_()
    if softcap is not None:
        extra["softcap"] = softcap
    causal = torch.full((SEQ, SEQ), -torch.inf, dtype=torch.float64).triu(1)[None, None]  # [1, 1, S, S]
    heads_first = [t.transpose(1, 2) for t in (q, k, v)]  # [B, H, S, D] as the models call it
    out, _ = _eager(model).eager_attention_forward(module, *heads_first, causal, scaling=scaling, **extra)
    out.backward(full[3].double())
    return out.detach(), q.grad, k.grad, v.grad, module.sinks.grad if sinks is not None else None


CASES = {  # model: (q/k head dim, v head dim, sinks, softcap, scaling)
    "gpt_oss": (16, 16, True, None, 16**-0.5),
    "gemma2": (16, 16, False, 5.0, 24**-0.5),  # query_pre_attn_scalar 24: a scaling that is not 1/sqrt(D)
    "deepseek_v3": (24, 16, False, None, 0.3),
}


def _errors(rank, world, kv_comm):
    mesh = init_mesh(ulysses=2, ring=2, kv_comm=kv_comm)
    errors = {}
    for model, (d, dv, has_sinks, softcap, scaling) in CASES.items():
        full = random_qkv(2, SEQ, HEADS, KV_HEADS, d, v_head_dim=dv, seed=len(model))
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).requires_grad_() if has_sinks else None
        q, k, v = (shard_sequence(t, mesh).clone().requires_grad_() for t in full[:3])
        out = hybrid_attn_func(q, k, v, mesh=mesh, softmax_scale=scaling, sinks=sinks, softcap=softcap)
        out.backward(shard_sequence(full[3], mesh))
        expected = _hf_reference(model, full, scaling, sinks, softcap)
        found = [rel_err(a, shard_sequence(e, mesh)) for a, e in zip([out, q.grad, k.grad, v.grad], expected)]
        if sinks is not None:
            summed = sinks.grad.clone()
            dist.all_reduce(summed, group=mesh.context_group)
            found.append(rel_err(summed, expected[4]))
        errors[model] = max(found)
    return errors


@pytest.mark.distributed
@pytest.mark.slow
def test_sinks_softcap_and_mla_dims_equal_the_models_eager_attention_at_u2_r2():
    for errors in run_distributed(_errors, 4, "ring"):  # each rank imports the three model modules: ~20 s
        assert set(errors) == set(CASES) and all(e < 1e-5 for e in errors.values()), errors


@pytest.mark.parametrize("model", list(CASES))
def test_one_process_call_equals_the_models_eager_attention(model):
    d, dv, has_sinks, softcap, scaling = CASES[model]
    full = random_qkv(2, SEQ, HEADS, KV_HEADS, d, v_head_dim=dv, seed=len(model))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).requires_grad_() if has_sinks else None
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    out = ring_attention(q, k, v, None, softmax_scale=scaling, sinks=sinks, softcap=softcap)
    out.backward(full[3])
    expected = _hf_reference(model, full, scaling, sinks, softcap)
    got = [out, q.grad, k.grad, v.grad] + ([sinks.grad] if has_sinks else [])
    errors = [rel_err(a, e) for a, e in zip(got, expected)]
    assert max(errors) < 1e-5, errors
