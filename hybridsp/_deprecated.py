"""Old import paths that moved in 0.2, kept working for one release with a ``DeprecationWarning`` (keep-old-paths).

Each old module is a two-line file at its old path whose ``__getattr__`` is :func:`moved_module`:
``from hybridsp.layout.documents import Documents`` still works and says to write
``from hybridsp.layout import Documents``. The list of old paths is in docs/api.md.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Callable


def warn_deprecated(what: str, advice: str, stacklevel: int = 3) -> None:
    """The one deprecation warning of 0.2's moves: ``what`` goes in 0.3, ``advice`` says what to use instead
    (``stacklevel`` 3: the caller of the module ``__getattr__`` that calls this)."""
    warnings.warn(
        f"{what} is deprecated and will be removed in hybridsp 0.3: {advice}", DeprecationWarning, stacklevel=stacklevel
    )


def moved_module(old: str, new: str, face: str | None) -> Callable[[str], object]:
    """The module ``__getattr__`` of the old path ``old``: names resolve from ``new`` (the private
    module that holds them now) with a warning naming the public ``face`` that exports them, or
    saying that the name is private now."""

    def __getattr__(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(importlib.import_module(new), name)
        public = face is not None and name in getattr(importlib.import_module(face), "__all__", ())
        advice = f"import {name} from {face}" if public else f"{name} is private now ({new}) and may change"
        warn_deprecated(old, advice)
        return value

    return __getattr__


def renamed_names(package: str, renames: dict[str, tuple[str, object]]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package`` whose ``renames`` map an old name to ``(new name, the
    object)``: the old name still resolves, with a warning naming the new one."""

    def __getattr__(name: str) -> object:
        if name not in renames:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        new, value = renames[name]
        warn_deprecated(f"{package}.{name}", f"use {package}.{new}")
        return value

    return __getattr__
