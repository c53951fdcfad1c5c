"""The lean Ulysses all-to-all: exact resharding for B = 1 and B > 1, packed tensors of different
head counts, its adjoint, and the buffer property (outputs to heads are views of one buffer)."""

import pytest
import torch
import torch.distributed as dist

from hybridsp.testing import run_distributed

pytestmark = pytest.mark.distributed

LENGTH, HEAD_DIM = 6, 4


def _full(batch, heads, seed):
    """The full [B, U*L, H, D] tensor every rank knows; rank u holds tokens [u*L, (u+1)*L)."""
    return torch.randn(
        batch, dist.get_world_size() * LENGTH, heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed)
    )


def _check(rank, world):
    from hybridsp.attention._ulysses import heads_to_seq, seq_to_heads

    group, failures = dist.new_group(list(range(world))), []
    for batch in (1, 3):
        heads = (2 * world, world)  # q-like and k-like head counts, packed in one all-to-all
        full = [_full(batch, h, seed=10 * batch + i) for i, h in enumerate(heads)]
        local = [t[:, rank * LENGTH : (rank + 1) * LENGTH].clone().requires_grad_() for t in full]
        local[1] = local[1].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # heads-first input
        out = seq_to_heads(local, group)
        for t, o, h in zip(full, out, heads):
            per = h // world
            if not torch.equal(o, t[:, :, rank * per : (rank + 1) * per]):
                failures.append(f"B={batch} H={h}: seq_to_heads wrong")
        if len({o.untyped_storage().data_ptr() for o in out}) != 1:
            failures.append(f"B={batch}: outputs are not views of one receive buffer")
        if not all(o.transpose(1, 2)[0, 0].is_contiguous() for o in out):  # Note [heads-first]
            failures.append(f"B={batch}: outputs do not have dense heads-first planes")
        back = heads_to_seq(out, group)
        for t, b in zip(local, back):
            if not torch.equal(b, t):
                failures.append(f"B={batch}: heads_to_seq is not the inverse")
        seq_first = heads_to_seq([o.contiguous() for o in out], group)  # any input strides
        if not all(torch.equal(b, t) for t, b in zip(local, seq_first)):
            failures.append(f"B={batch}: heads_to_seq of seq-first storage is wrong")
        weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(out)]
        sum((o * w).sum() for o, w in zip(out, weights)).backward()
        for _tensor, w, h, leaf in zip(full, weights, heads, local):  # the adjoint: each rank's weights, back home
            gathered = [torch.empty_like(w) for _ in range(world)]
            dist.all_gather(gathered, w.contiguous(), group=group)
            expected = torch.cat(gathered, dim=2)[:, rank * LENGTH : (rank + 1) * LENGTH]  # [B, L, H, D]
            if not torch.equal(leaf.grad, expected):
                failures.append(f"B={batch} H={h}: gradient is not the adjoint")
    assert not failures, failures
    return True


@pytest.mark.fast  # tests/README.md
def test_lean_all_to_all_is_exact_and_hands_out_views():
    assert all(run_distributed(_check, 4))
