"""The token plan: every token placed once, the real ones on the first global positions (pure, no model)."""

from __future__ import annotations

import pytest
import torch

from hybridsp.integrations.diffusers._plan import build_plan, layout_positions
from tests.helpers.mesh import mesh_at

pytestmark = pytest.mark.integration  # pure and quick (no model), but it lives under tests/integrations


def _plans(ulysses, ring, layout, real):
    return [
        build_plan(mesh_at(ulysses, ring, r=r, u=u, layout=layout), real) for r in range(ring) for u in range(ulysses)
    ]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("ulysses", "ring"), [(2, 1), (1, 2), (2, 2), (1, 3), (2, 3)])
@pytest.mark.parametrize(
    ("text", "image", "hidden"), [(0, 1, 0), (0, 15, 0), (5, 13, 0), (1, 7, 0), (7, 11, 3), (3, 40, 2)]
)
def test_every_token_is_placed_once_and_the_real_ones_on_the_first_positions(
    layout, ulysses, ring, text, image, hidden
):
    real = {"img": torch.ones(image, dtype=torch.bool)}
    if text:
        real = {"txt": torch.arange(text) < text - hidden, **real}
    plans = _plans(ulysses, ring, layout, real)
    for name, mask in real.items():
        index = plans[0].stream(name).index  # [C, L]: the same on every rank
        placed = index[index < mask.numel()]
        assert sorted(placed.tolist()) == torch.nonzero(mask).flatten().tolist()
    mesh = mesh_at(ulysses, ring, layout=layout)
    positions = layout_positions(mesh, plans[0].joint_local)  # [C, Lj]
    total = int(sum(m.sum() for m in real.values()))
    for rank, plan in enumerate(plans):
        slot_real = plan.local_real()[plan.order]  # [Lj] in attention-position order
        assert torch.equal(slot_real, positions[rank] < total)
        assert torch.equal(plan.order[plan.restore], torch.arange(plan.joint_local))
        bounds = None if plan.cu_seqlens is None else plan.cu_seqlens.tolist()
        assert bounds == (None if total == positions.numel() else [0, total, positions.numel()])
