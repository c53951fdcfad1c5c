import math

import torch

from hybridsp.attention._merge import merge_blocks
from tests.helpers.references.attention import rel_err

INF = math.inf


def _attend(scores, values):
    """Softmax attention of given scores [B, H, S, K] over values [B, K, H, D] and its lse."""
    lse = torch.logsumexp(scores, -1)  # [B, H, S]
    out = torch.einsum("bhsk,bkhd->bshd", torch.softmax(scores, -1), values)  # [B, S, H, D]
    return out, lse


def test_merge_of_split_keys_equals_full_attention():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 12, generator=gen, dtype=torch.float64) * 20  # large: tests stability
    values = torch.randn(2, 12, 3, 4, generator=gen, dtype=torch.float64)
    full_out, full_lse = _attend(scores, values)
    parts = [_attend(scores[..., i : i + 4], values[:, i : i + 4]) for i in (0, 4, 8)]
    out, lse = merge_blocks([p[0] for p in parts], [p[1] for p in parts])
    assert rel_err(out, full_out) < 1e-6
    assert rel_err(lse, full_lse) < 1e-6


def test_merge_is_stable_for_huge_lse():
    out_a, out_b = torch.ones(1, 1, 1, 2), 3 * torch.ones(1, 1, 1, 2)
    lse_a, lse_b = torch.full((1, 1, 1), 1e4), torch.full((1, 1, 1), 1e4)
    out, lse = merge_blocks([out_a, out_b], [lse_a, lse_b])
    assert torch.allclose(out, 2 * torch.ones_like(out))
    assert torch.allclose(lse, torch.full_like(lse, 1e4 + math.log(2)))


def test_blocks_without_visible_keys_never_produce_nan():
    # Row 0 sees keys only in block a; row 1 only in block b (block a reports -inf, block b +inf
    # for the rows they do not see, as different kernels do); row 2 sees no key at all.
    out_a = torch.tensor([[[[1.0, 2.0]], [[0.0, 0.0]], [[0.0, 0.0]]]])  # [B=1, S=3, H=1, D=2]
    out_b = torch.tensor([[[[0.0, 0.0]], [[5.0, 6.0]], [[0.0, 0.0]]]])
    lse_a = torch.tensor([[[0.5, -INF, -INF]]])  # [B, H, S]
    lse_b = torch.tensor([[[INF, 0.7, INF]]])
    out, lse = merge_blocks([out_a, out_b], [lse_a, lse_b])
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, 0], torch.tensor([[1.0, 2.0], [5.0, 6.0], [0.0, 0.0]]))
    assert lse[0, 0, 0].item() == 0.5 and abs(lse[0, 0, 1].item() - 0.7) < 1e-7
    assert lse[0, 0, 2].item() == -INF
