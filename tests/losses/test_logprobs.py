"""hybridsp.losses._logprobs against single-process float64 math (U2 x R1 on 2 ranks, U2 x R2 on 4).

Every rank takes its shard of the same full logits (a leaf), computes a DPO-style loss from
:func:`sequence_logprobs` (per-sequence sums, non-linear in them) and a GRPO-style loss from
:func:`gather_tokens` (per-token values, clipped ratios), and backpropagates. The values must
equal the unsharded losses on every rank, and the shards' gradients, put back in token order,
must equal the unsharded gradient (Note [local gradient]: the context ranks' gradients sum to it).
"""

import pytest
import torch
import torch.nn.functional as F

from hybridsp.testing import run_distributed

B, S, V = 4, 24, 11  # S a multiple of 2 x R x U for both meshes


def _full_inputs():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, V, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, V, (B, S), generator=generator)
    labels[:, :5] = -100  # an unscored prompt
    labels[1, 17:] = -100  # a shorter row
    old = torch.randn(B, S, generator=generator, dtype=torch.float64) * 0.1  # "old policy" log-prob offsets
    return logits, labels, old


def _losses(seq_logp: torch.Tensor, token_logp: torch.Tensor, labels: torch.Tensor, old: torch.Tensor):
    """(DPO-style loss of the per-sequence sums, GRPO-style clipped loss of the per-token values)."""
    chosen, rejected = seq_logp.chunk(2)
    dpo = -F.logsigmoid(0.5 * (chosen - rejected)).mean()
    ratio = torch.exp(token_logp - (token_logp.detach() + old))
    advantage = torch.linspace(-1.0, 1.0, B, dtype=token_logp.dtype)[:, None]
    scored = (labels != -100).to(token_logp.dtype)
    per_token = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage)
    return dpo, (per_token * scored).sum() / scored.sum()


def _reference():
    from hybridsp.losses._logprobs import token_logprobs

    logits, labels, old = _full_inputs()
    logits.requires_grad_(True)
    token_logp = token_logprobs(logits, labels).double()  # [B, S]
    dpo, grpo = _losses(token_logp.sum(dim=1), token_logp, labels, old)
    (dpo + grpo).backward()
    return dpo.item(), grpo.item(), logits.grad


def _sharded(rank, world_size, ulysses, ring):
    from hybridsp import gather_sequence, init_mesh, shard_sequence
    from hybridsp.losses._logprobs import gather_tokens, sequence_logprobs, token_logprobs

    mesh = init_mesh(ulysses=ulysses, ring=ring)
    logits, labels, old = _full_inputs()
    local_logits = shard_sequence(logits.float(), mesh).requires_grad_(True)  # [B, S/C, V]
    local_labels = shard_sequence(labels, mesh)  # [B, S/C]
    seq_logp = sequence_logprobs(local_logits, local_labels, mesh).double()  # [B]
    token_logp = gather_tokens(token_logprobs(local_logits, local_labels), mesh).double()  # [B, S]
    dpo, grpo = _losses(seq_logp, token_logp, labels, old)
    (dpo + grpo).backward()
    grad = gather_sequence(local_logits.grad, mesh)  # [B, S, V]: every position from the rank that holds it
    return dpo.item(), grpo.item(), grad


@pytest.mark.distributed
@pytest.mark.parametrize("ulysses,ring,world", [(2, 1, 2), (2, 2, 4)])
def test_sharded_logprob_losses_and_gradients_equal_unsharded(ulysses, ring, world):
    dpo, grpo, grad = _reference()
    for rank_dpo, rank_grpo, rank_grad in run_distributed(_sharded, world, ulysses, ring, timeout=120):
        assert abs(rank_dpo - dpo) <= 1e-5 * abs(dpo) and abs(rank_grpo - grpo) <= 1e-5 * abs(grpo)
        torch.testing.assert_close(rank_grad.double(), grad, rtol=1e-4, atol=1e-6)


def _bad_target_on_one_rank(rank, world, which):
    """U1 x R2: a target outside the vocabulary [0, V) sits on the last rank only."""
    from hybridsp import init_mesh
    from hybridsp.losses._logprobs import gather_tokens, sequence_logprobs, token_logprobs

    mesh = init_mesh(ulysses=1, ring=world)
    logits = torch.randn(2, 6, V, requires_grad=True)
    labels = torch.randint(0, V, (2, 6))
    if rank == world - 1:
        labels[1, 2], labels[0, 4] = V + 3, -7  # two bad ids; -100 stays ignored
    try:
        if which == "sequence":
            sequence_logprobs(logits, labels, mesh)
        else:
            gather_tokens(token_logprobs(logits, labels, mesh=mesh), mesh)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.distributed
@pytest.mark.parametrize("which", ["sequence", "token"])
def test_a_target_outside_the_vocabulary_on_one_rank_raises_on_every_rank(which):
    messages = run_distributed(_bad_target_on_one_rank, 2, which, timeout=60)  # a hang fails within a minute
    for rank, message in enumerate(messages):
        assert message and f"2 target id(s) in shift_labels lie outside the vocabulary [0, {V})" in message, message
        assert f"this rank ({rank}) has {2 if rank == 1 else 0}" in message, message


def test_token_logprobs_without_a_mesh_names_the_bad_target():
    from hybridsp.losses._logprobs import token_logprobs

    labels = torch.tensor([[1, 2, V, -100]])
    with pytest.raises(ValueError, match=rf"1 target id\(s\) .* outside the vocabulary \[0, {V}\).*e\.g\. \[{V}\]"):
        token_logprobs(torch.randn(1, 4, V), labels)
    assert token_logprobs(torch.randn(1, 4, V), labels.clamp(max=V - 1))[0, 3] == 0  # ignore_index: 0
