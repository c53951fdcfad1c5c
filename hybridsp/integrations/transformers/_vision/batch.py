"""Vision-language batches (Qwen2-VL, Qwen2.5-VL) -> this rank's tokens, positions and vision work.

    local = shard_vlm_batch(batch, mesh, model)            # no communication
    labels, documents = local.pop("shift_labels"), local.pop("documents")
    out = model(**local, hybridsp_documents=documents, use_cache=False)
    loss = hybridsp.sharded_cross_entropy(out.logits, labels, mesh)

``model`` is a Qwen2-VL / Qwen2.5-VL model switched with ``apply(model, mesh)``: its forward
pre-hook (:mod:`hybridsp.integrations.transformers._vision.model`) runs the vision encoder on the work this function
assigned to the rank and hands the language model exactly the features of the rank's own
image and video tokens.

Shape legend: B rows, S tokens, S_pad S padded to the layout's multiple, C = U * R context
ranks, P patches (rows of ``pixel_values``), F = 3 * temporal_patch * patch^2 values per
patch, m the spatial merge size (m^2 patches make one language-model token).

Note [vision units]: Qwen2-VL's and Qwen2.5-VL's vision encoders attend within one temporal
patch of one image or video at a time (their ``cu_seqlens`` give each of the ``t`` frames of a
``(t, h, w)`` grid its own segment; Qwen2.5-VL's windows lie inside a frame), and every other
layer works per patch or per m x m block. So a grid ``(t, h, w)`` is ``t`` independent *units*
``(1, h, w)``: ``h * w`` consecutive rows of ``pixel_values`` that become ``h * w / m^2``
consecutive features, i.e. consecutive image (or video) tokens of the sequence. Units are the
granularity at which the encoder's work is divided over the context ranks.

Note [who encodes what]: ``vision="local"``: each rank encodes the units that have
at least one token in its shard (a unit that straddles a shard boundary is encoded by each
rank that holds part of it; at most one extra unit per boundary), no communication.
``vision="split"``: the units are cut into C contiguous runs of about equal patch counts, each
rank encodes one run, and one ``all_to_all`` over the context group sends every feature to the
rank that holds its token (its backward sends the gradients home). ``vision="auto"`` (default)
takes local unless its busiest rank would encode more than ``SPLIT_WHEN`` = 1.25 times the patches
of split's busiest rank (measured, ``benchmarks/bench_vlm_memory.py``: a long video spreads its
frames over the shards and both cost the same on the busiest rank, local without the exchange;
16 images at the start of a 4k-token sequence put them all on one rank in local mode, and split
is 2.5x cheaper there). Every rank always calls
the encoder exactly once per forward when the batch has images or videos (a rank with no unit
encodes one m x m dummy unit whose output it uses zero rows of): ZeRO-3 gathers parameters
collectively on each encoder call, so all ranks must make the same calls.

Note [text-only batches]: a micro-batch without images or videos never calls the encoder, but
under ZeRO-3 every encoder call gathers its parameters collectively over the data-parallel ranks
(and its backward reduces their gradients): with DP > 1, a replica whose micro-batch is text-only
would make fewer calls than one with images, and DeepSpeed fails ("disagreement on list length")
or hangs. ``shard_vlm_batch(..., idle_encoder=True)`` (what ``HybridSPTrainer`` passes for a
vision-language model) gives such a batch the dummy unit of Note [who encodes what]: its features
reach the model as zero image features (no image token takes them), so the loss is unchanged and
the encoder's parameters get zero gradients. ``mm_token_type_ids`` (which Qwen2-VL's processor also
emits for text) only feeds ``get_rope_index``; text-only positions are 0, 1, 2, ... as the model's own.

Note [multimodal positions]: the model's own ``get_rope_index`` computes the 3-D (temporal,
height, width) RoPE positions on the full, unpadded batch; padding continues counting after a
row's largest position (it is never attended and carries no loss); then the positions are cut
with :func:`hybridsp.shard_sequence` like the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from hybridsp.attention._api import shard_sequence
from hybridsp.data._batch import batch_documents, prepare_batch
from hybridsp.layout._layouts import layout_permutation
from hybridsp.losses._cross_entropy import IGNORE_INDEX
from hybridsp.mesh._hybrid_mesh import HybridMesh

VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
TEXT_KEYS = ("input_ids", "labels", "attention_mask")
EXTRA_KEYS = ("mm_token_type_ids", "second_per_grid_ts")
VISION_MODES = ("auto", "local", "split")
SPLIT_WHEN = 1.25  # "auto" splits when local mode's busiest rank encodes 25% more patches than split's


@dataclass
class Exchange:
    """Split mode: rows of this rank's encoded features to send, and the split sizes (group rank order)."""

    send_rows: torch.Tensor  # [sum send_counts] int64 rows of the encoded features, by destination
    send_counts: list[int]  # [C] per destination group rank
    recv_counts: list[int]  # [C] per source group rank


@dataclass
class VisionShard:
    """One rank's vision-encoder work for one sharded forward (built by :func:`shard_vlm_batch`).

    Attributes:
        pixels: [P_local, F] the patches of the units this rank encodes (a dummy unit if none).
        grid: [n_units, 3] int64, ``(1, h, w)`` per unit (Note [vision units]).
        image_rows, video_rows: int64 rows of the features available on this rank (encoded, or
            received in split mode) for this rank's image / video tokens, in local token order.
        has_images, has_videos: whether the *batch* has images / videos (all ranks agree).
        exchange: split mode's all_to_all plan, None in local mode.
    """

    pixels: torch.Tensor
    grid: torch.Tensor
    image_rows: torch.Tensor
    video_rows: torch.Tensor
    has_images: bool
    has_videos: bool
    exchange: Exchange | None = None

    def __repr__(self) -> str:
        return (
            f"VisionShard({self.grid.shape[0]} units, {self.pixels.shape[0]} patches, "
            f"{self.image_rows.numel()} image / {self.video_rows.numel()} video tokens here)"
        )


def is_vision_batch(batch: Mapping[str, Any]) -> bool:
    """True if the batch holds any image or video input."""
    return any(torch.is_tensor(batch.get(key)) for key in VISION_KEYS)


def text_fields(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The keys :func:`hybridsp.data._batch.prepare_batch` cuts (input_ids, labels, attention_mask)."""
    return {key: batch[key] for key in TEXT_KEYS if torch.is_tensor(batch.get(key))}


def shard_vlm_batch(
    batch: Mapping[str, Any],
    mesh: HybridMesh,
    model,
    *,
    vision: str = "auto",
    pad_token_id: int = 0,
    ignore_index: int = IGNORE_INDEX,
    idle_encoder: bool = False,
) -> dict[str, Any]:
    """This rank's shard of a full vision-language batch. No communication.

    Args:
        batch: ``input_ids`` [B, S], ``labels`` [B, S] (unshifted), optional ``attention_mask``
            [B, S] (right padding), ``pixel_values`` [P_img, F] with ``image_grid_thw`` [N_img, 3],
            ``pixel_values_videos`` [P_vid, F] with ``video_grid_thw`` [N_vid, 3], optional
            ``mm_token_type_ids`` [B, S] (derived from the image/video token ids when absent) and
            ``second_per_grid_ts`` [N_vid] (Qwen2.5-VL). The same full batch on every context rank.
        mesh: the mesh the model was switched with.
        model: the Qwen2-VL / Qwen2.5-VL model (``...ForConditionalGeneration`` or ``...Model``);
            only its config and ``get_rope_index`` are used.
        vision: ``"auto"`` (default), ``"local"`` or ``"split"`` (Note [who encodes what]).
        idle_encoder: a text-only batch still gets a ``hybridsp_vision``: the encoder runs once on
            a dummy unit whose output no token uses (Note [text-only batches]).

    Returns:
        ``input_ids`` [B, S_pad / C], ``position_ids`` [3, B, S_pad / C] (multimodal RoPE),
        ``shift_labels`` [B, S_pad / C], ``documents`` (one per row, as :func:`hybridsp.shard_batch`
        gives them: pass ``hybridsp_documents=local["documents"]``) and, when the batch has images or
        videos (or ``idle_encoder``), ``hybridsp_vision`` (a :class:`VisionShard`). Pass the rest to the model.

    Raises:
        ValueError for unknown keys, a bad ``vision`` mode, or token counts that do not match the grids.
    """
    _check_keys(batch, vision)
    if mesh.layout not in ("zigzag", "contiguous"):
        raise ValueError(
            f"vision-language batches are cut in the zigzag or contiguous layout; got layout "
            f"{mesh.layout!r}: build the mesh with layout='zigzag'"
        )
    text = prepare_batch(text_fields(batch), mesh, pad_token_id=pad_token_id, ignore_index=ignore_index)
    input_ids = text["input_ids"]  # [B, S_pad]
    plan = plan_vision(batch, input_ids, mesh, model, vision) if is_vision_batch(batch) else None  # checks counts
    positions = multimodal_positions(batch, model, input_ids.shape[1])  # [3, B, S_pad]
    local = {
        "input_ids": shard_sequence(input_ids, mesh),
        "position_ids": shard_sequence(positions, mesh, dim=2),
        "shift_labels": shard_sequence(text["shift_labels"], mesh),
        "documents": batch_documents(text["position_ids"]),  # one per row; pass as hybridsp_documents=
    }
    if plan is None and idle_encoder:
        plan = idle_vision_shard(model, input_ids.device)
    return local if plan is None else {**local, "hybridsp_vision": plan}


def idle_vision_shard(model, device: torch.device | str = "cpu") -> VisionShard:
    """A :class:`VisionShard` for a text-only batch (Note [text-only batches]): one zero m x m unit
    (pixels [m^2, F], F = channels x temporal patch x patch^2), no rows used, no image token."""
    config, merge = model.config.vision_config, merge_size(model)
    features = int(config.in_channels) * int(config.temporal_patch_size) * int(config.patch_size) ** 2
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return VisionShard(
        pixels=torch.zeros(merge * merge, features, device=device),
        grid=torch.tensor([[1, merge, merge]], device=device),
        image_rows=empty,
        video_rows=empty,
        has_images=True,
        has_videos=False,
    )


def _check_keys(batch: Mapping[str, Any], vision: str) -> None:
    known = TEXT_KEYS + VISION_KEYS + EXTRA_KEYS
    unknown = sorted(k for k, v in batch.items() if torch.is_tensor(v) and k not in known)
    if unknown:
        raise ValueError(
            f"shard_vlm_batch does not know how to shard {unknown}; it takes {', '.join(known)} (the 3-D "
            f"position_ids are computed here). Remove the other tensors"
        )
    if vision not in VISION_MODES:
        raise ValueError(f"vision must be one of {VISION_MODES}; got {vision!r}")
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if torch.is_tensor(batch.get(pixels)) != torch.is_tensor(batch.get(grid)):
            raise ValueError(f"{pixels} and {grid} come together; got only one of them")


def token_ids(model) -> tuple[int, int]:
    """(image_token_id, video_token_id) of a Qwen2-VL-family config."""
    config = model.config
    return int(config.image_token_id), int(config.video_token_id)


def merge_size(model) -> int:
    return int(model.config.vision_config.spatial_merge_size)


def multimodal_positions(batch: Mapping[str, Any], model, padded: int) -> torch.Tensor:
    """[3, B, S_pad] RoPE positions from the model's ``get_rope_index`` (Note [multimodal positions])."""
    input_ids, mask = batch["input_ids"], batch.get("attention_mask")
    image_id, video_id = token_ids(model)
    types = batch.get("mm_token_type_ids")
    if types is None:
        types = (input_ids == image_id).int() + 2 * (input_ids == video_id).int()  # [B, S]
    extra = {"second_per_grid_ts": batch["second_per_grid_ts"]} if batch.get("second_per_grid_ts") is not None else {}
    inner = model.model if hasattr(getattr(model, "model", None), "get_rope_index") else model
    positions, _ = inner.get_rope_index(
        input_ids,
        mm_token_type_ids=types,
        image_grid_thw=batch.get("image_grid_thw"),
        video_grid_thw=batch.get("video_grid_thw"),
        attention_mask=mask,
        **extra,
    )  # [3, B, S]
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()  # [B, S]
    real = torch.nn.functional.pad(real, (0, padded - input_ids.shape[1]), value=False)  # [B, S_pad]
    positions = torch.nn.functional.pad(positions, (0, padded - input_ids.shape[1]))  # [3, B, S_pad]
    after = positions.masked_fill(~real, -1).amax(dim=(0, 2)) + 1  # [B] the first free position
    counting = after[:, None] + (~real).long().cumsum(dim=1) - 1  # [B, S_pad] on the padding
    return torch.where(real, positions, counting.expand_as(positions)).long()  # [3, B, S_pad]


# --------------------------------------------------------------------------- vision work


@dataclass
class _Units:
    """All units of the batch (images first, then videos), Note [vision units]."""

    patch_start: torch.Tensor  # [N] first row of the unit in its modality's pixel tensor
    feature_start: torch.Tensor  # [N] first feature in the combined (images, then videos) feature order
    hw: torch.Tensor  # [N, 2] (h, w) in patches
    video: torch.Tensor  # [N] bool

    @property
    def patches(self) -> torch.Tensor:
        return self.hw[:, 0] * self.hw[:, 1]  # [N]


def _units(image_grid, video_grid, merge: int) -> _Units:
    starts, features, hw, video = [], [], [], []
    feature = 0
    for is_video, grid in ((False, image_grid), (True, video_grid)):
        patch = 0
        for t, h, w in [] if grid is None else grid.tolist():
            for _ in range(t):
                starts.append(patch)
                features.append(feature)
                hw.append((h, w))
                video.append(is_video)
                patch += h * w
                feature += h * w // merge**2
    return _Units(
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(features, dtype=torch.long),
        torch.tensor(hw, dtype=torch.long).view(-1, 2),
        torch.tensor(video, dtype=torch.bool),
    )


def _token_features(input_ids: torch.Tensor, model, units: _Units) -> torch.Tensor:
    """[B, S_pad] int64: each vision token's index in the combined feature order, -1 for text.

    ValueError, quoting the counts, when tokens and grids disagree.
    """
    image_id, video_id = token_ids(model)
    merge = merge_size(model)
    feature_of = torch.full_like(input_ids, -1).view(-1)  # [B * S_pad]
    offset = 0
    for is_video, token in ((False, image_id), (True, video_id)):
        flat = (input_ids.reshape(-1) == token).nonzero().squeeze(1)  # [n] in row-major order
        expected = int((units.patches[units.video == is_video] // merge**2).sum())
        if flat.numel() != expected:
            kind = "video" if is_video else "image"
            raise ValueError(
                f"the batch has {flat.numel()} {kind} tokens (id {token}) but its {kind} grids give {expected} "
                f"features (patches / {merge}^2): give every {kind} as many tokens as its grid"
            )
        feature_of[flat] = torch.arange(offset, offset + flat.numel())
        offset += flat.numel()
    return feature_of.view_as(input_ids)  # [B, S_pad]


def plan_vision(batch: Mapping[str, Any], input_ids: torch.Tensor, mesh: HybridMesh, model, vision: str) -> VisionShard:
    """This rank's :class:`VisionShard` (Note [who encodes what]). ``input_ids`` [B, S_pad] padded."""
    merge = merge_size(model)
    units = _units(batch.get("image_grid_thw"), batch.get("video_grid_thw"), merge)
    feature_of = _token_features(input_ids.cpu(), model, units)  # [B, S_pad]
    counts = units.patches // merge**2  # [N] features per unit
    unit_of = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [n_features]
    video_feature = torch.repeat_interleave(units.video, counts)  # [n_features]
    shards = _shard_features(feature_of, mesh)  # [C] each [n_j] feature ids in shard j's token order
    needed = shards[mesh.context_rank]
    owner = _balanced_owners(units.patches, mesh.context)  # [N] shard index of each unit's encoder (split)
    if vision == "auto":
        vision = choose_vision_mode(shards, owner, units, unit_of)
    if vision == "local":
        encode = torch.unique(unit_of[needed])  # sorted unit ids
        rows = _rows_in(encode, needed, units, counts, unit_of)
        exchange = None
    else:
        encode = (owner == mesh.context_rank).nonzero().squeeze(1)
        rows, exchange = _exchange_plan(shards, owner, encode, units, counts, unit_of, mesh)
    pixels, grid = _unit_pixels(batch, units, encode, merge)
    device = input_ids.device
    return VisionShard(
        pixels=pixels,
        grid=grid.to(device),
        image_rows=rows[~video_feature[needed]].to(device),
        video_rows=rows[video_feature[needed]].to(device),
        has_images=torch.is_tensor(batch.get("image_grid_thw")),
        has_videos=torch.is_tensor(batch.get("video_grid_thw")),
        exchange=exchange,
    )


def choose_vision_mode(shards: list[torch.Tensor], owner: torch.Tensor, units: _Units, unit_of) -> str:
    """``"split"`` if local mode's busiest rank would encode more than :data:`SPLIT_WHEN` times the
    patches of split mode's busiest rank, else ``"local"`` (no exchange). The same on every rank."""
    local = max(int(units.patches[torch.unique(unit_of[ids])].sum()) for ids in shards)
    split = max(int(units.patches[owner == j].sum()) for j in range(len(shards)))
    return "split" if local > SPLIT_WHEN * split else "local"


def _shard_features(feature_of: torch.Tensor, mesh: HybridMesh) -> list[torch.Tensor]:
    """Per shard index j, the feature ids of shard j's vision tokens in its local (row-major) order."""
    order = layout_permutation(feature_of.shape[1], mesh.ring, mesh.ulysses, mesh.layout)  # [S_pad]
    per_shard = feature_of[:, order].view(feature_of.shape[0], mesh.context, -1).transpose(0, 1)  # [C, B, S_pad/C]
    return [ids[ids >= 0] for ids in per_shard.reshape(mesh.context, -1)]


def _rows_in(encode: torch.Tensor, features: torch.Tensor, units: _Units, counts, unit_of) -> torch.Tensor:
    """Rows of ``features`` (combined feature ids) in the concatenated output of the units ``encode``."""
    start = torch.zeros(len(counts), dtype=torch.long)
    start[encode] = torch.cumsum(counts[encode], 0) - counts[encode]  # each encoded unit's first output row
    unit = unit_of[features]
    return start[unit] + features - units.feature_start[unit]


def _balanced_owners(patches: torch.Tensor, ranks: int) -> torch.Tensor:
    """[N] shard index per unit: C contiguous runs of about equal patch counts."""
    ends = torch.cumsum(patches, 0).double()  # [N]
    centre = ends - patches.double() / 2
    return (centre * ranks / ends[-1]).long().clamp(max=ranks - 1) if len(patches) else patches


def _exchange_plan(shards, owner, encode, units: _Units, counts, unit_of, mesh: HybridMesh):
    """(rows into the received features for this rank's tokens, :class:`Exchange`)."""
    members = mesh.context_members()  # shard order
    group_rank = {member: index for index, member in enumerate(sorted(members))}
    shard_of_group = {group_rank[member]: shard for shard, member in enumerate(members)}
    me = mesh.context_rank
    sends, send_counts, recv_counts = [], [], []
    for g in range(mesh.context):  # the all_to_all's order: group ranks
        wanted = shards[shard_of_group[g]]
        mine = wanted[owner[unit_of[wanted]] == me]
        sends.append(_rows_in(encode, mine, units, counts, unit_of))
        send_counts.append(mine.numel())
        from_g = shards[me]
        recv_counts.append(int((owner[unit_of[from_g]] == shard_of_group[g]).sum()))
    needed = shards[me]
    source = torch.tensor([group_rank[members[int(o)]] for o in owner[unit_of[needed]]], dtype=torch.long)
    order = torch.sort(source, stable=True).indices  # received blocks come in source order, inner in token order
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel())
    return rows, Exchange(torch.cat(sends) if sends else torch.zeros(0, dtype=torch.long), send_counts, recv_counts)


def _unit_pixels(batch: Mapping[str, Any], units: _Units, encode: torch.Tensor, merge: int):
    """([P_local, F] pixels, [n, 3] grids) of the units ``encode``, or one zero m x m dummy unit."""
    images, videos = batch.get("pixel_values"), batch.get("pixel_values_videos")
    reference = images if torch.is_tensor(images) else videos
    if encode.numel() == 0:
        assert reference is not None  # a vision batch: pixels come with their grids (_check_keys)
        return reference.new_zeros(merge * merge, reference.shape[-1]), torch.tensor([[1, merge, merge]])
    pieces = []
    for unit in encode.tolist():
        source = videos if bool(units.video[unit]) else images
        assert source is not None  # the unit's grid came with its pixels (_check_keys)
        start = int(units.patch_start[unit])
        pieces.append(source[start : start + int(units.patches[unit])])  # [h * w, F]
    grid = torch.cat([torch.ones(len(encode), 1, dtype=torch.long), units.hw[encode]], dim=1)  # [n, 3]
    return torch.cat(pieces), grid
