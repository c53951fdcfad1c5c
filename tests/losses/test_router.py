"""sharded_load_balancing_loss against transformers' load_balancing_loss_func on the full sequence.

The reference is transformers' own function (Mixtral's; Qwen3-MoE, GPT-OSS and OLMoE share it) on the
full, unsharded router logits of 3 layers with the full ``attention_mask``. Ours: each rank's shard of
the logits (cut by the batch's layout, padded by ``shard_batch`` to the layout's multiple with logits that
must not count) and :func:`hybridsp.real_token_mask`. Value on every rank and the gradient of every
router logit (gathered from the ranks) must match: B = 2 rows right-padded differently, no mask, a
batch with no real token (0, never NaN), packed rows under the balanced layout, bf16 logits; at U2 x R2
and at an odd ring of 3.
"""

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
from tests.helpers.references.attention import rel_err

BATCH, SEQ, EXPERTS, TOP_K, LAYERS = 2, 29, 6, 2, 3  # 29: shard_batch pads every mesh here
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


def _reference(logits, mask):
    """(value, d logits [L, B, S, E]) of transformers' function on the full sequence (fp32 sums)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = logits.clone().requires_grad_()
    value = load_balancing_loss_func(tuple(logits.flatten(1, 2)), EXPERTS, TOP_K, mask)  # layers [B * S, E]
    value.backward()
    return value.detach(), logits.grad


def _cases():
    """name -> (attention_mask [B, S] or None, position_ids or None, dtype, layout)."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, 21:] = 0  # right padding, a different length per row
    mask[1, 11:] = 0
    packed = torch.cat([torch.arange(12), torch.arange(10), torch.arange(7)]).expand(BATCH, SEQ)  # 3 documents
    return {
        "padded": (mask, None, torch.float32, "zigzag"),
        "no mask": (None, None, torch.float32, "zigzag"),
        "nothing real": (torch.zeros_like(mask), None, torch.float32, "zigzag"),
        "packed balanced": (None, packed, torch.float32, "balanced"),
        "padded bf16": (mask, None, torch.bfloat16, "zigzag"),
    }


def _sharded(mesh, logits, mask, positions):
    """(value, d logits [L, B, S, E] gathered from the ranks) of ours on this rank's shard."""
    from hybridsp import gather_sequence, real_token_mask, shard_batch, shard_sequence, sharded_load_balancing_loss

    batch = {"input_ids": torch.ones(BATCH, SEQ, dtype=torch.long), "labels": torch.ones(BATCH, SEQ, dtype=torch.long)}
    batch.update({k: v for k, v in (("attention_mask", mask), ("position_ids", positions)) if v is not None})
    local_batch = shard_batch(batch, mesh)
    seq_pad = local_batch["input_ids"].shape[1] * mesh.context
    garbage = 50 * torch.randn(LAYERS, BATCH, seq_pad - SEQ, EXPERTS, generator=torch.Generator().manual_seed(5))
    padded = torch.cat([logits, garbage.to(logits.dtype)], dim=2)  # [L, B, S_pad, E]: shard_batch's padding
    local = torch.stack([shard_sequence(layer, mesh, cu_seqlens=local_batch["documents"]) for layer in padded])
    local = local.clone().requires_grad_()  # [L, B, S_local, E]
    token_mask = real_token_mask(batch, mesh, local_batch["documents"])  # [B, S_local]
    value = sharded_load_balancing_loss(list(local.flatten(1, 2)), token_mask, mesh, num_experts=EXPERTS, top_k=TOP_K)
    value.backward()
    grads = [gather_sequence(layer, mesh, cu_seqlens=local_batch["documents"]) for layer in local.grad]
    return value.detach(), torch.stack(grads)  # [L, B, S_pad, E]


def _check(rank, world, meshes, cases):
    """Every case on every mesh; ``cases``: name -> (mask, positions, layout, logits, expected, expected_grad)."""
    from hybridsp import init_mesh

    failures = []
    for ulysses, ring in meshes:
        for name, (mask, positions, layout, logits, expected, expected_grad) in cases.items():
            mesh = init_mesh(ulysses=ulysses, ring=ring, layout=layout)
            value, grads = _sharded(mesh, logits, mask, positions)
            where = f"U{ulysses}xR{ring} {name}"
            if grads[:, :, SEQ:].abs().max() != 0:
                failures.append(f"{where}: shard_batch's padding got a gradient")
            if expected is None:  # no real token: transformers gives 0/0 = NaN; ours exactly 0
                if value.item() != 0 or grads.abs().max() != 0:
                    failures.append(f"{where}: {value.item()} (expected 0, no gradient)")
                continue
            errors = (rel_err(value, expected), rel_err(grads[:, :, :SEQ], expected_grad))
            if max(errors) > TOLERANCE[logits.dtype]:
                failures.append(f"{where}: value {value.item()} vs {expected.item()}, errors {errors}")
    assert not failures, "\n".join(failures)
    return True


@pytest.fixture(scope="module")
def cases():
    """The cases with transformers' answers, computed here (the workers need not import transformers)."""
    prepared = {}
    for name, (mask, positions, dtype, layout) in _cases().items():
        logits = torch.randn(LAYERS, BATCH, SEQ, EXPERTS, generator=torch.Generator().manual_seed(3)).to(dtype)
        expected = _reference(logits, mask) if name != "nothing real" else (None, None)
        prepared[name] = (mask, positions, layout, logits, *expected)
    return prepared


@pytest.mark.distributed
def test_whole_sequence_value_and_gradients_at_u2xr2(cases):
    assert all(run_distributed(_check, 4, [(2, 2)], cases, timeout=120))


@pytest.mark.distributed
def test_whole_sequence_value_and_gradients_at_an_odd_ring(cases):
    assert all(run_distributed(_check, 3, [(1, 3)], cases, timeout=120))


def test_a_shard_alone_is_not_the_whole_sequence():
    """What the helper fixes: the per-shard loss (the model's own on S / C tokens) differs from the whole's."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = torch.randn(LAYERS, BATCH * SEQ, EXPERTS, generator=torch.Generator().manual_seed(3))
    whole = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    halves = [load_balancing_loss_func(tuple(part), EXPERTS, TOP_K) for part in logits.chunk(2, dim=1)]
    assert abs((halves[0] + halves[1]) / 2 - whole) > 1e-4


def _call(router_logits, token_mask=None, experts=EXPERTS, top_k=TOP_K):
    from hybridsp import sharded_load_balancing_loss

    return sharded_load_balancing_loss(router_logits, token_mask, mesh_at(2, 2), num_experts=experts, top_k=top_k)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(router_logits=None), "output_router_logits=True"),
        (dict(router_logits=()), "output_router_logits=True"),
        (dict(router_logits=torch.zeros(8, EXPERTS)), "a Tensor"),
        (dict(router_logits=[torch.zeros(8, EXPERTS + 1)]), "have 7 experts"),
        (dict(router_logits=[torch.zeros(8, EXPERTS), torch.zeros(6, EXPERTS)]), "different token counts [6, 8]"),
        (dict(router_logits=[torch.zeros(8, EXPERTS, dtype=torch.long)]), "must be a float"),
        (dict(router_logits=[torch.zeros(8, EXPERTS)], token_mask=torch.ones(2, 3)), "holds 6 entries for 8"),
        (dict(router_logits=[torch.zeros(8, EXPERTS)], top_k=EXPERTS + 1), "top_k=7, num_experts=6"),
    ],
)
def test_bad_input_is_a_value_error_before_any_collective(arguments, message):
    # mesh_at has no process groups: reaching the all_reduce would fail otherwise
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _call(**arguments)
