"""Whether a class's ``forward`` is, statement for statement, a reference class's (syntax trees compared).

Split checkpointing (:mod:`hybridsp.memory._split_checkpoint`) takes decoder layers whose forward is
``LlamaDecoderLayer``'s; the donated attention inputs (:mod:`hybridsp.memory._qkv_donation`) take
attention modules whose forward is ``LlamaAttention``'s; lean RoPE (:mod:`hybridsp.memory._rope_attention`)
replaces such forwards and also checks the family's rotary functions (:func:`same_function`). All rest
on what that code does with its tensors, so they compare the code itself, not class names.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache
from typing import Any

from torch import nn


def forward_body(cls: type) -> str | None:
    """The syntax tree of ``cls.forward``'s body (under every ``functools.wraps`` wrapper), or None
    when its source cannot be read."""
    return function_body(getattr(cls, "forward", None))


def function_body(function: Any) -> str | None:
    """The syntax tree of ``function``'s body (under every ``functools.wraps`` wrapper), or None when
    its source cannot be read."""
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
    function = _hub_function(function)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return ast.dump(ast.Module(body=definition.body, type_ignores=[]))


def _hub_function(function: Any) -> Any:
    """The plain function under a ``kernels`` hub wrapper (``use_kernel_forward_from_hub`` on a function
    makes a module whose forward calls it, absent a hub kernel), else ``function`` itself."""
    forward = getattr(type(function), "forward", None)
    if not isinstance(function, nn.Module) or forward is None or forward.__closure__ is None:
        return function
    return inspect.getclosurevars(forward).nonlocals.get("func", function)


@lru_cache(maxsize=None)
def has_forward_of(cls: type, reference: type) -> bool:
    """True when ``cls.forward``'s body is ``reference.forward``'s (both readable)."""
    body = forward_body(cls)
    return body is not None and body == forward_body(reference)


def same_function(function: Any, reference: Any) -> bool:
    """True when ``function``'s body is ``reference``'s (both readable; decorators unwrapped)."""
    body = function_body(function)  # None for None or an unreadable function
    return body is not None and body == function_body(reference)
