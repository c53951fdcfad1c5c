"""The packed documents of one batch, normalised once on the host and shared by every layer.

``cu_seqlens`` arrive in many forms (flash-attn's varlen convention over the *global*
sequence): an int tensor/list ``[N + 1]`` shared by every row, a ``[B, N + 1]`` tensor, a list
of B per-row tensors/lists, or ``None`` (one document per row). :func:`as_documents` turns any of
them into a :class:`Documents`: Python ints validated once, hashable, plus a memo in which the
attention keeps what it derives from them (the token layout, the block plan, the call's
agreement fingerprint). :func:`hybridsp.shard_batch` builds one per batch and every layer of a
model reuses it, so the per-layer path reads no device tensor and rebuilds nothing (the ranks'
agreement is still checked per call, Note [agreement] in :mod:`hybridsp.attention._resolve`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any, Callable, SupportsInt, TypeVar, Union, cast

import torch

from hybridsp._opaque import OpaqueRef

Rows = tuple[tuple[int, ...], ...]
_T = TypeVar("_T")


class Documents:
    """Per-row global document boundaries of one batch (``rows``: None when every row is one document).

    Attributes:
        batch: B. seq_len: the global (unsharded) sequence length S.
        rows: ``B`` tuples ``(0, ..., S)`` (empty documents dropped), or None.
        window: the sliding window a layout that places tokens by document balanced this batch
            for (Note [placement window] in :mod:`hybridsp.layout._layouts`); None: the mesh's.
        memo: derived data keyed by what determines it (plans, layouts, agreement fingerprints).
        opaque: an :class:`~hybridsp._opaque.OpaqueRef` to this object, for a compiled graph.
    """

    __slots__ = ("batch", "seq_len", "rows", "window", "memo", "opaque", "_digest")

    def __init__(self, batch: int, seq_len: int, rows: Rows | None = None, window: int | None = None):
        self.batch, self.seq_len, self.rows, self.window = batch, seq_len, rows, window
        self.memo: dict[Any, Any] = {}
        self.opaque = OpaqueRef(self)  # what a compiled graph hands the attention operator
        self._digest: tuple[int, ...] | None = None  # two 62-bit halves

    @property
    def packed(self) -> bool:
        """Whether any row holds more than one document."""
        return self.rows is not None

    def row(self, b: int) -> tuple[int, ...]:
        """Row ``b``'s boundaries ``(0, ..., S)``."""
        return (0, self.seq_len) if self.rows is None else self.rows[b]

    def key(self) -> tuple[int, int, Rows | None, int | None]:
        """A hashable value that determines everything derived from these documents."""
        return (self.batch, self.seq_len, self.rows, self.window)

    def digest(self) -> tuple[int, ...]:
        """Two 62-bit halves of a BLAKE2 digest of the boundaries (for cross-rank agreement checks)."""
        if self._digest is None:
            raw = hashlib.blake2b(repr(self.key()).encode(), digest_size=16).digest()
            self._digest = tuple(int.from_bytes(raw[i : i + 8], "little") & ((1 << 62) - 1) for i in (0, 8))
        return self._digest

    def to(self, *args: object, **kwargs: object) -> Documents:
        """Host data: unchanged (so ``{k: v.to(device) for k, v in shard_batch(...).items()}`` works)."""
        return self

    def remember(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """``compute()`` once per object and ``key``."""
        if key not in self.memo:
            self.memo[key] = compute()
        return cast(_T, self.memo[key])  # the memo holds many kinds of value: the key determines which

    def __repr__(self) -> str:
        docs = 1 if self.rows is None else max(len(row) - 1 for row in self.rows)
        window = "" if self.window is None else f", window={self.window}"
        return f"Documents(batch={self.batch}, seq_len={self.seq_len}, max_docs_per_row={docs}{window})"


CuSeqlensInput = Union[torch.Tensor, Sequence[Any], Documents, None]
"""``cu_seqlens`` in any accepted form (the module docstring), checked at run time; array-likes (numpy)
are accepted at run time as well and read like tensors."""


def chunked_documents(documents: Documents, chunk: int) -> Documents:
    """``documents`` with every document cut every ``chunk`` tokens from its start: chunked local attention
    (Llama 4's ``attention_chunk_size``) as block-diagonal documents, so the block plan expresses it. Kept in
    the memo of ``documents`` (one per batch and chunk size, shared by every chunked layer); the placement
    window is kept (the tokens stay where the batch's documents put them)."""
    if chunk < 1:
        raise ValueError(f"attention_chunk_size must be a positive number of tokens; got {chunk}")
    return documents.remember(
        ("chunked", chunk),
        lambda: Documents(
            documents.batch,
            documents.seq_len,
            tuple(_cut_row(documents.row(b), chunk) for b in range(documents.batch)),
            documents.window,
        ),
    )


def _cut_row(bounds: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """Row boundaries ``(0, ..., S)`` with a cut every ``chunk`` tokens inside each document."""
    cuts = [start + step for start, end in zip(bounds, bounds[1:]) for step in range(0, end - start, chunk)]
    return (*cuts, bounds[-1])


def as_documents(cu_seqlens: CuSeqlensInput, batch: int, seq_len: int) -> Documents:
    """A :class:`Documents` for ``cu_seqlens`` in any accepted form (see the module docstring).

    A :class:`Documents` passes through after checking it describes ``batch`` rows of ``seq_len``
    tokens. Raises ValueError (no communication) for anything malformed.
    """
    if isinstance(cu_seqlens, Documents):
        if (cu_seqlens.batch, cu_seqlens.seq_len) != (batch, seq_len):
            raise ValueError(
                f"the documents describe {cu_seqlens.batch} rows of {cu_seqlens.seq_len} tokens but the call has "
                f"{batch} rows of {seq_len} global tokens (local tokens x context ranks); pass the batch's own documents"
            )
        return cu_seqlens
    return Documents(batch, seq_len, normalize_cu_seqlens(cu_seqlens, batch, seq_len))


def normalize_cu_seqlens(cu_seqlens: CuSeqlensInput, batch: int, seq_len: int) -> Rows | None:
    """Document boundaries per batch row as tuples, or None when every row is one document.

    Accepts an int tensor/array/list ``[N + 1]`` (the same documents in every row), a
    ``[B, N + 1]`` tensor or array, or a list of ``B`` such 1-D sequences (rows may hold different
    numbers of documents), or a :class:`Documents`. Each must start at 0, end at ``seq_len`` (the
    global, unsharded length) and never decrease (empty documents are dropped). Raises ValueError
    otherwise (floats, booleans, wrong rank or length).
    """
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Documents):
        return as_documents(cu_seqlens, batch, seq_len).rows
    rows = _rows_of(cu_seqlens, batch)
    checked = tuple(_checked_row(row, index, seq_len) for index, row in enumerate(rows))
    if all(len(row) == 2 for row in checked):
        return None
    return checked


def _rows_of(cu_seqlens: torch.Tensor | Sequence[Any], batch: int) -> list[list[Any]]:
    """cu_seqlens in any accepted form -> B lists of values (checked to be integers later)."""
    if not torch.is_tensor(cu_seqlens) and hasattr(cu_seqlens, "__array__"):  # numpy and friends
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if torch.is_tensor(cu_seqlens):
        if (
            cu_seqlens.is_floating_point()
            or cu_seqlens.is_complex()
            or cu_seqlens.dtype == torch.bool
            or cu_seqlens.dim() not in (1, 2)
        ):
            raise ValueError(
                f"cu_seqlens must be an integer tensor [num_docs + 1] or [B, num_docs + 1]; got "
                f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        rows = [cu_seqlens.tolist()] * batch if cu_seqlens.dim() == 1 else cu_seqlens.tolist()
    else:
        rows = list(cu_seqlens)
        if (
            rows
            and not isinstance(rows[0], (list, tuple))
            and not torch.is_tensor(rows[0])
            and not hasattr(rows[0], "__array__")
        ):
            return [rows] * batch
        rows = [torch.as_tensor(r).tolist() if torch.is_tensor(r) or hasattr(r, "__array__") else list(r) for r in rows]
    if len(rows) != batch:
        raise ValueError(
            f"cu_seqlens gives documents for {len(rows)} batch rows but the batch has {batch}; give one "
            f"[num_docs + 1] boundary list per row (or a single 1-D tensor shared by every row)"
        )
    return rows


def _as_int(value: SupportsInt, index: int) -> int:
    """One boundary as an int; ValueError for floats, booleans and other non-integers."""
    if isinstance(value, bool) or not isinstance(value, int):
        if hasattr(value, "dtype") and not getattr(value.dtype, "is_floating_point", True):
            return int(value)
        raise ValueError(
            f"cu_seqlens row {index} must hold integer token boundaries; got {value!r} ({type(value).__name__})"
        )
    return value


def _checked_row(row: list[Any], index: int, seq_len: int) -> tuple[int, ...]:
    """One row's boundaries, validated against the global sequence length; empty docs dropped."""
    row = [_as_int(x, index) for x in row]
    if len(row) < 2 or row[0] != 0 or row[-1] != seq_len:
        raise ValueError(
            f"cu_seqlens row {index} must run from 0 to the global sequence length {seq_len} (the unsharded "
            f"length, local tokens x context ranks); got {row[:4]}{'...' if len(row) > 4 else ''} ending at "
            f"{row[-1] if row else None}"
        )
    drops = [i for i in range(1, len(row)) if row[i] < row[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(f"cu_seqlens row {index} decreases from {row[i - 1]} to {row[i]} at entry {i}")
    return tuple(b for i, b in enumerate(row) if i == 0 or b != row[i - 1])
