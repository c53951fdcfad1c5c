"""The window ``layout="balanced"`` places a switched model's tokens for (Note [layout window] in
:mod:`hybridsp.integrations.transformers._switch`): read from the layers, the majority's, and the
forward pre-hook refusing documents placed for another one (one process, a mesh without groups:
the refusal comes before anything communicates)."""

from __future__ import annotations

import pytest
import torch

from hybridsp.integrations import transformers as hf
from hybridsp.layout._documents import Documents
from tests.helpers.mesh import mesh_at
from tests.helpers.models.switched import build

pytestmark = pytest.mark.integration

CONFIGS = [  # (family, overrides, the layers' windows, the layout's window)
    ("llama", {}, [None, None], None),
    ("mistral", dict(sliding_window=6), [6, 6], 6),
    ("qwen2", dict(use_sliding_window=True, sliding_window=10, max_window_layers=1), [None, 10], None),
    (
        "qwen2",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=10, max_window_layers=1),
        [None, 10, 10],
        10,
    ),
    (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=7, layer_types=["sliding_attention", "full_attention"]),
        [7, None],
        None,
    ),
]


@pytest.mark.parametrize("family, overrides, layers, chosen", CONFIGS)
def test_the_layout_window_is_the_majority_of_the_layers(family, overrides, layers, chosen):
    model = build(family, **overrides)
    assert hf.layer_windows(model) == layers
    assert hf.layout_window(model) == chosen


def test_the_pre_hook_refuses_documents_placed_for_another_window():
    model = build("mistral", sliding_window=6)
    mesh = mesh_at(1, 2, layout="balanced")
    rows = ((0, 20, 64),)
    ids = torch.randint(1, 128, (1, 32))
    positions = torch.arange(32)[None]
    with hf.apply(model, mesh, backend="torch"):
        with pytest.raises(
            ValueError, match="placed this batch's tokens for sliding_window=None but the model's layers use 6"
        ):
            model(input_ids=ids, position_ids=positions, hybridsp_documents=Documents(1, 64, rows), use_cache=False)
        with pytest.raises(ValueError, match="sliding_window=4 but the model's layers use 6"):
            model(
                input_ids=ids,
                position_ids=positions,
                hybridsp_documents=Documents(1, 64, rows, window=4),
                use_cache=False,
            )
