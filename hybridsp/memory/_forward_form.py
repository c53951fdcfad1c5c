"""Whether a class's ``forward`` is, statement for statement, a reference class's (syntax trees compared).

Split checkpointing (:mod:`hybridsp.memory._split_checkpoint`) takes decoder layers whose forward is
``LlamaDecoderLayer``'s; the donated attention inputs (:mod:`hybridsp.memory._qkv_donation`) take
attention modules whose forward is ``LlamaAttention``'s. Both rest on what that code does with its
tensors, so both compare the code itself, not class names.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import lru_cache
from typing import Any


def forward_body(cls: type) -> str | None:
    """The syntax tree of ``cls.forward``'s body (under every ``functools.wraps`` wrapper), or None
    when its source cannot be read."""
    forward: Any = getattr(cls, "forward", None)
    while hasattr(forward, "__wrapped__"):
        forward = forward.__wrapped__
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return ast.dump(ast.Module(body=function.body, type_ignores=[]))


@lru_cache(maxsize=None)
def has_forward_of(cls: type, reference: type) -> bool:
    """True when ``cls.forward``'s body is ``reference.forward``'s (both readable)."""
    body = forward_body(cls)
    return body is not None and body == forward_body(reference)
