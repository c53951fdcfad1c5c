"""Batch sharding: a full causal-LM batch -> this rank's tokens in the mesh's token layout.

    local = shard_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, mesh)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)

Every rank of a context group must start from the same full batch (:class:`ShardedDataLoader`
wraps a DataLoader that yields it; :func:`replica_sampler` gives each data-parallel replica its
own samples). The steps, all on the full sequence and without communication:

1. Labels are masked at padding and shifted *before* sharding (Note [shift first]).
2. The sequence is padded on the right to the layout's multiple (pad id in ``input_ids``,
   ``ignore_index`` in ``shift_labels``).
3. ``position_ids`` become the tokens' global positions, so RoPE sees the right angles
   after the layout permutes the tokens.
4. :func:`hybridsp.shard_sequence` takes this rank's tokens of each tensor.

Note [shift first]: a causal LM predicts token ``i + 1`` at position ``i``. Shifting each
shard separately would lose the target of every shard's last token (its target lives on
another rank) and, with the zigzag layout, pair tokens that are not neighbours at all.
Shifting the full sequence first gives every token its true target, wherever it lands.

Note [right padding]: with causal attention a real token never attends to the padding after
it, so ignoring the padding's targets gives exactly the unsharded model's loss on the real
tokens without any attention mask. Left padding or holes in the middle would need a mask:
:func:`shard_batch` refuses them.

Note [packed rows]: a row may hold several documents, ``position_ids`` restarting at 0 at
each one (transformers' ``DataCollatorWithFlattening``, TRL's packing). The positions are
kept as given (RoPE restarts per document), the target of every document's last token
becomes ``ignore_index`` (no loss across a boundary, whatever the labels say), and the
attention finds the documents from the same restarts: :func:`batch_documents` turns them into the
batch's :class:`~hybridsp.layout._documents.Documents` once, on the host, and :func:`shard_batch` hands
them on (``local["documents"]``) to the model and to layouts that place tokens by document
(``layout="balanced"``). Any other jump in ``position_ids`` is refused.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist

from hybridsp.attention._api import shard_tensors
from hybridsp.layout._documents import Documents, normalize_cu_seqlens
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from hybridsp.mesh._hybrid_mesh import HybridMesh, padded_length

BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
_T = TypeVar("_T")


def prepare_batch(
    batch: Mapping[str, Any], mesh: HybridMesh, *, pad_token_id: int = 0, ignore_index: int = IGNORE_INDEX
) -> dict[str, torch.Tensor]:
    """The full, padded batch that :func:`shard_batch` cuts: shifted labels, global positions.

    Returns ``input_ids``, ``shift_labels`` and ``position_ids``, each [B, S_pad] with
    ``S_pad = padded_length(S, mesh)``. No communication. Arguments as in :func:`shard_batch`.
    """
    input_ids, labels, mask, positions = _validated(batch)
    labels = labels.masked_fill(mask == 0, ignore_index) if mask is not None else labels
    shift_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)  # [B, S]
    if positions is not None:  # Note [packed rows]: no target across a document boundary
        shift_labels = shift_labels.masked_fill(_document_ends(positions, mask), ignore_index)  # [B, S]
    extra = padded_length(input_ids.shape[1], mesh) - input_ids.shape[1]
    input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=pad_token_id)  # [B, S_pad]
    shift_labels = torch.nn.functional.pad(shift_labels, (0, extra), value=ignore_index)  # [B, S_pad]
    positions = _global_positions(positions, input_ids, mask)  # [B, S_pad]
    return {"input_ids": input_ids, "shift_labels": shift_labels, "position_ids": positions}


def shard_batch(
    batch: Mapping[str, Any],
    mesh: HybridMesh,
    *,
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    sliding_window: int | None = None,
) -> dict[str, torch.Tensor | Documents]:
    """This rank's shard of a full causal-LM batch, in the mesh's token layout.

    Args:
        batch: ``input_ids`` [B, S] and ``labels`` [B, S] (unshifted, as Hugging Face collators
            give them: the model predicts ``labels[:, i + 1]`` at token ``i``); optional
            ``attention_mask`` [B, S] (1 = real token; right padding only) and
            ``position_ids`` [B, S] or [1, S] (consecutive within a row; default 0..S-1).
            Values that are not tensors are ignored; other tensors raise ValueError.
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh` whose ``(ring_rank, ulysses_rank)`` picks the shard.
        pad_token_id: fills ``input_ids`` where the sequence is padded to the layout's multiple.
        ignore_index: the target that carries no loss (padding, the last token of a row).
        sliding_window: the model's window, which ``layout="balanced"`` balances work for
            (default: the mesh's ``sliding_window``); carried on ``documents`` so that the
            attention and :func:`hybridsp.gather_sequence` use the same placement
            (Note [placement window] in :mod:`hybridsp.layout._layouts`). A switched HF model
            checks it against its config (:func:`hybridsp.integrations.transformers.layout_window`).

    Returns:
        ``input_ids``, ``shift_labels`` and ``position_ids``, each [B, S_pad / C] on the
        input's device, with ``S_pad = padded_length(S, mesh)`` and ``C = U * R``, and
        ``documents``: the batch's packed documents (:class:`~hybridsp.layout._documents.Documents`, host
        data; ``.to(device)`` returns it unchanged). Pass ``input_ids`` and ``position_ids`` to the
        model (a switched HF model also takes ``hybridsp_documents=local["documents"]``: the
        attention then plans once per batch and needs no collective to find the documents; the
        balanced layout requires it) and ``shift_labels`` to
        :func:`~hybridsp.losses._cross_entropy.sharded_cross_entropy`. No communication. Each
        row's layout is computed once for all three tensors.
    """
    full = prepare_batch(batch, mesh, pad_token_id=pad_token_id, ignore_index=ignore_index)
    window = mesh.sliding_window if sliding_window is None else sliding_window
    documents = batch_documents(full["position_ids"], window)
    local = dict(zip(full, shard_tensors(list(full.values()), mesh, cu_seqlens=documents)))
    return {**local, "documents": documents}


def _validated(batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(input_ids, labels, attention_mask or None, position_ids or None), checked; ValueError otherwise."""
    unknown = sorted(k for k, v in batch.items() if torch.is_tensor(v) and k not in BATCH_KEYS)
    if unknown:
        raise ValueError(
            f"shard_batch does not know how to shard {unknown}; it shards {', '.join(BATCH_KEYS)}. "
            f"Remove the other tensors or shard them yourself with hybridsp.shard_sequence"
        )
    for key in ("input_ids", "labels"):
        if not torch.is_tensor(batch.get(key)):
            raise ValueError(f"the batch needs a {key!r} tensor [B, S]; got keys {sorted(batch)}")
    input_ids, labels = batch["input_ids"], batch["labels"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S]; got shape {tuple(input_ids.shape)}")
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    for key, value in (("labels", labels), ("attention_mask", mask)):
        if value is not None and value.shape != input_ids.shape:
            raise ValueError(f"{key} {tuple(value.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
    if mask is not None:
        _check_right_padding(mask)
    if positions is not None:
        positions = _checked_positions(positions, input_ids, mask)
    return input_ids, labels, mask, positions


def _check_right_padding(mask: torch.Tensor) -> None:
    """Raise ValueError unless every row of the [B, S] mask is 1...1 0...0 (Note [right padding])."""
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError(
            f"attention_mask must hold only 0 and 1; got values {sorted(mask.unique().tolist())[:8]}. "
            f"Packed-sequence masks need document masking, which hybridsp does not support"
        )
    rises = (mask[:, 1:] > mask[:, :-1]).nonzero()
    if rises.numel():
        row, index = rises[0].tolist()
        raise ValueError(
            f"attention_mask row {row} has a real token at index {index + 1} after padding: hybridsp's causal "
            f"masking handles right padding only. Pad on the right (tokenizer.padding_side = 'right')"
        )


def _checked_positions(positions: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """position_ids as [B, S], refusing rows whose real tokens are not consecutive positions."""
    batch, seq = input_ids.shape
    if positions.dim() != 2 or positions.shape[1] != seq or positions.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids {tuple(positions.shape)} must be [B, S] or [1, S] for input_ids {tuple(input_ids.shape)}"
        )
    positions = positions.expand_as(input_ids)  # [B, S]
    steps = positions[:, 1:] - positions[:, :-1]  # [B, S-1]
    real = mask[:, 1:] != 0 if mask is not None else torch.ones_like(steps, dtype=torch.bool)
    restarts = positions[:, 1:] == 0  # a new packed document (Note [packed rows])
    jumps = ((steps != 1) & ~restarts & real).nonzero()
    if jumps.numel():
        row, index = jumps[0].tolist()
        raise ValueError(
            f"position_ids row {row} jumps from {positions[row, index].item()} to {positions[row, index + 1].item()} "
            f"at token {index + 1}: within a row positions must count up by one, or restart at 0 where a packed "
            f"document begins. Give each sequence its own row, restart packed documents at 0, or omit position_ids"
        )
    return positions


def _document_ends(positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, S] bool: real tokens whose next token starts a new packed document (position 0)."""
    starts_next = torch.cat([positions[:, 1:] == 0, torch.zeros_like(positions[:, :1], dtype=torch.bool)], 1)
    if mask is not None:
        starts_next &= torch.cat([mask[:, 1:] != 0, torch.zeros_like(mask[:, :1], dtype=torch.bool)], 1)
    return starts_next  # [B, S]


def _global_positions(
    positions: torch.Tensor | None, input_ids: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, S_pad] positions: given positions on real tokens (packed rows keep their restarts);
    padding, and rows without positions, continue counting from the last real token."""
    steps = torch.arange(input_ids.shape[1], device=input_ids.device)  # [S_pad]
    if positions is None:
        return steps.expand_as(input_ids).to(torch.long).clone()  # [B, S_pad]
    seq = positions.shape[1]
    real = torch.ones_like(positions, dtype=torch.bool) if mask is None else mask != 0  # [B, S]
    real = torch.nn.functional.pad(real, (0, input_ids.shape[1] - seq), value=False)  # [B, S_pad]
    given = torch.nn.functional.pad(positions, (0, input_ids.shape[1] - seq))  # [B, S_pad]
    last = (real.long() * steps).amax(dim=1, keepdim=True)  # [B, 1] index of the last real token
    continued = given.gather(1, last) + steps - last  # [B, S_pad] counting on from there
    return torch.where(real & (steps <= last), given, continued).to(torch.long)  # [B, S_pad]


def replica_sampler(
    dataset: torch.utils.data.Dataset[_T], mesh: HybridMesh, **kwargs: Any
) -> torch.utils.data.DistributedSampler[_T]:
    """A DistributedSampler over the data-parallel replicas only: every context rank of a
    replica draws the same samples (pass the same ``seed`` everywhere). No communication."""
    return torch.utils.data.DistributedSampler(dataset, num_replicas=mesh.dp, rank=mesh.dp_rank, **kwargs)


class ShardedDataLoader:
    """Iterate a DataLoader of full batches and yield this rank's :func:`shard_batch` of each.

    The wrapped loader must yield the same full batch on every rank of a context group (use
    :func:`replica_sampler`). ``check_same_batch=True`` verifies that with one small
    ``all_reduce`` over ``mesh.context_group`` per batch and raises ValueError on every rank
    of the group when the batches differ. ``device`` moves each tensor before sharding.
    """

    def __init__(
        self,
        loader: torch.utils.data.DataLoader[Any],
        mesh: HybridMesh,
        *,
        pad_token_id: int = 0,
        ignore_index: int = IGNORE_INDEX,
        device: torch.device | str | None = None,
        check_same_batch: bool = False,
    ) -> None:
        self.loader, self.mesh, self.device, self.check_same_batch = loader, mesh, device, check_same_batch
        self.pad_token_id, self.ignore_index = pad_token_id, ignore_index

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor | Documents]]:
        for batch in self.loader:
            if self.device is not None:
                batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if self.check_same_batch:
                check_same_across_context(batch["input_ids"], self.mesh)
            yield shard_batch(batch, self.mesh, pad_token_id=self.pad_token_id, ignore_index=self.ignore_index)


def batch_fingerprint(input_ids: torch.Tensor) -> torch.Tensor:
    """[4] int64: rows, columns and 124 bits of a BLAKE2 digest of the ids' bytes (no aliasing by position).

    Each digest half is kept to 62 bits so that negating it (the MAX/MIN trick of
    :func:`check_same_across_context`) never overflows int64.
    """
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest()
    halves = [int.from_bytes(digest[i : i + 8], "little") & ((1 << 62) - 1) for i in (0, 8)]
    return torch.tensor([*ids.shape[-2:], *halves] if ids.dim() >= 2 else [1, ids.numel(), *halves], dtype=torch.int64)


def check_same_across_context(input_ids: torch.Tensor, mesh: HybridMesh) -> None:
    """Raise ValueError on every rank of the context group unless all hold the same ``input_ids``.

    Compares :func:`batch_fingerprint` (shape and a hash of the bytes, so any change of any
    token is seen, e.g. two tokens swapped) with one all_reduce (MAX of the fingerprint and of
    its negation) over ``mesh.context_group``.
    """
    if mesh.context == 1:
        return
    fingerprint = batch_fingerprint(input_ids).to(input_ids.device)  # [4]
    extremes = torch.cat([fingerprint, -fingerprint])  # [8]
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=mesh.context_group)
    if not torch.equal(extremes[:4], -extremes[4:]):
        raise ValueError(
            f"the ranks of context group {mesh.context_members()} loaded different batches (rank {mesh.rank}: "
            f"input_ids {tuple(input_ids.shape)}): every context rank of a replica must load the same full batch; "
            f"use hybridsp.data._batch.replica_sampler(dataset, mesh) with the same seed on every rank"
        )


def batch_documents(position_ids: torch.Tensor, window: int | None = None) -> Documents:
    """The packed documents of full (padded, unsharded) ``position_ids`` [B, S] as host data: a
    document starts at each row's first token and wherever the position is 0; ``window``: the
    placement window they carry (``Documents.window``)."""
    batch, seq_len = position_ids.shape
    rows = normalize_cu_seqlens(packed_cu_seqlens(position_ids.cpu()), batch, seq_len)
    return Documents(batch, seq_len, rows, window)


def packed_cu_seqlens(position_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the document boundaries ``[num_docs + 1]`` (int64) of full (unsharded)
    ``position_ids`` [B, S]: a document starts at index 0 and wherever the position is 0.
    The form :func:`hybridsp.hybrid_attn_func` takes as ``cu_seqlens`` (one entry per row)."""
    rows = []
    for row in position_ids:
        starts = (row == 0).nonzero().flatten()  # [N?]
        starts = starts if starts.numel() and starts[0] == 0 else torch.cat([starts.new_zeros(1), starts])
        rows.append(torch.cat([starts, starts.new_tensor([row.numel()])]).long())  # [N + 1]
    return rows
