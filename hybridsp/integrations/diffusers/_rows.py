"""Rows of one batch with different text masks: the switched transformer runs them one by one.

Note [rows with different masks]: a token plan (``_plan``) places the real tokens of a forward on the first
global positions, which one placement can do for every row only when the rows hide the same text tokens.
When a batch's text mask differs between rows (Qwen-Image prompts of different lengths, padded), the
transformer's own forward is replaced, for this instance only and undoably, by one that calls the switched
transformer on each row alone (a batch of one always shares its mask) and concatenates the outputs along
the batch. Rows of a diffusion transformer never mix (its norms are per token), so this is the batched
result; the cost is one sharded forward per row instead of one for the batch.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch

from hybridsp.integrations.diffusers._families import Family

Undo = Callable[[], None]


def rows_differ(family: Family, arguments: dict[str, Any]) -> bool:
    """The family's text mask is given and not the same in every row of the batch."""
    mask = arguments.get(family.mask_arg) if family.mask_arg else None
    if not isinstance(mask, torch.Tensor) or mask.ndim < 2 or mask.shape[0] < 2:
        return False
    rows = mask.bool()  # [B, T_txt]
    return not bool((rows == rows[:1]).all())


def install_row_split(transformer: torch.nn.Module, family: Family) -> Undo:
    """Replace ``transformer.forward`` (this instance) by one that runs differing rows one by one; the undo."""
    original = transformer.forward

    @functools.wraps(original)  # inspect.signature (the switch's hooks bind by it) still sees the real forward
    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        if not rows_differ(family, bound.arguments):
            return original(*args, **kwargs)
        return _row_by_row(transformer, bound.arguments)

    transformer.forward = forward

    def undo() -> None:
        vars(transformer).pop("forward", None)

    return undo


def _row(arguments: dict[str, Any], index: int, batch: int) -> dict[str, Any]:
    """Row ``index`` of every batched argument (a tensor or a list with ``batch`` entries), the rest as is."""
    row = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == batch:
            value = value[index : index + 1]  # [1, ...]
        elif isinstance(value, (list, tuple)) and len(value) == batch:
            value = type(value)(value[index : index + 1])
        row[name] = value
    return row


def _row_by_row(transformer: torch.nn.Module, arguments: dict[str, Any]) -> Any:
    """The switched transformer on each row alone (its hooks plan each row), outputs concatenated: [B, ...]."""
    batch = int(arguments["hidden_states"].shape[0])
    outputs = [transformer(**_row(arguments, index, batch)) for index in range(batch)]
    return_dict = arguments.get("return_dict", True)
    sample = torch.cat([out.sample if return_dict else out[0] for out in outputs], dim=0)  # [B, ...]
    return type(outputs[0])(sample=sample) if return_dict else (sample,)
