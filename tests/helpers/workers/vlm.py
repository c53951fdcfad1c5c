"""Tiny Qwen2-VL / Qwen2.5-VL models and multimodal batches for the vision-language tests.

Everything is built from configs with random weights and random pixels (nothing downloaded,
no processor): ``pixel_values`` rows are patches of ``3 x 2 x 4 x 4`` values, grids are in
patches, and every image/video contributes ``t * h * w / 4`` tokens (spatial merge 2).
"""

from __future__ import annotations

import torch

VOCAB, IMAGE, VIDEO, START, END = 96, 90, 91, 92, 93
PATCH, TEMPORAL, MERGE = 4, 2, 2
FEATURES = 3 * TEMPORAL * PATCH * PATCH  # values per patch row


def tiny_vlm(kind: str = "qwen2_vl", seed: int = 0, dtype=torch.float32):
    """A 2-layer language model (hidden 64, 4 query / 2 K/V heads) with a 2-block vision tower."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=2, num_heads=2, patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, in_channels=3
    )
    ids = dict(
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    if kind == "qwen2_vl":
        config = Qwen2VLConfig(
            text_config=text, vision_config=dict(vision, embed_dim=32, hidden_size=64, mlp_ratio=2), **ids
        )
        model = Qwen2VLForConditionalGeneration(config)
    else:
        config = Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(
                vision,
                hidden_size=32,
                out_hidden_size=64,
                intermediate_size=64,
                window_size=16,
                fullatt_block_indexes=[1],
            ),
            **ids,
        )
        model = Qwen2_5_VLForConditionalGeneration(config)
    return model.to(dtype)


def sample(generator: torch.Generator, pieces: list, dtype=torch.float32) -> dict:
    """One row: ``pieces`` is a list of text lengths (int) and ("image" | "video", (t, h, w)) entries."""
    ids, pixels, videos, image_grid, video_grid = [], [], [], [], []
    for piece in pieces:
        if isinstance(piece, int):
            ids += torch.randint(3, 80, (piece,), generator=generator).tolist()
            continue
        kind, (t, h, w) = piece
        ids += [START] + [IMAGE if kind == "image" else VIDEO] * (t * h * w // MERGE**2) + [END]
        patches = torch.randn(t * h * w, FEATURES, generator=generator, dtype=torch.float64).to(dtype)
        (pixels if kind == "image" else videos).append(patches)
        (image_grid if kind == "image" else video_grid).append([t, h, w])
    row = {"input_ids": torch.tensor(ids)}
    labels = row["input_ids"].clone()
    labels[(labels == IMAGE) | (labels == VIDEO)] = -100
    row["labels"] = labels
    if pixels:
        row["pixel_values"], row["image_grid_thw"] = torch.cat(pixels), torch.tensor(image_grid)
    if videos:
        row["pixel_values_videos"], row["video_grid_thw"] = torch.cat(videos), torch.tensor(video_grid)
    return row


def collate(rows: list[dict]) -> dict:
    """Right padding (pad 0, labels -100); pixels and grids concatenated in row order; mm_token_type_ids."""
    longest = max(len(row["input_ids"]) for row in rows)
    batch = {"input_ids": [], "labels": [], "attention_mask": []}
    for row in rows:
        pad = longest - len(row["input_ids"])
        batch["input_ids"].append(torch.nn.functional.pad(row["input_ids"], (0, pad), value=0))
        batch["labels"].append(torch.nn.functional.pad(row["labels"], (0, pad), value=-100))
        batch["attention_mask"].append(torch.nn.functional.pad(torch.ones_like(row["input_ids"]), (0, pad)))
    batch = {key: torch.stack(value) for key, value in batch.items()}  # each [B, S]
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if any(key in row for row in rows):
            batch[key] = torch.cat([row[key] for row in rows if key in row])
    batch["mm_token_type_ids"] = (batch["input_ids"] == IMAGE).int() + 2 * (batch["input_ids"] == VIDEO).int()
    return batch


def mixed_batch(seed: int = 0, dtype=torch.float32) -> dict:
    """Two rows with several images and a 3-frame video each, spanning shards at C = 4."""
    generator = torch.Generator().manual_seed(seed)
    first = [5, ("image", (1, 4, 4)), 7, ("image", (1, 4, 6)), 3, ("video", (3, 4, 4)), 9]
    second = [3, ("video", (2, 4, 6)), 4, ("image", (1, 6, 4)), 11, ("image", (1, 2, 2)), 2]
    return collate([sample(generator, first, dtype), sample(generator, second, dtype)])


def reference(model, batch: dict):
    """(logits [B, S, V], loss, {name: grad}) of the unmodified model on the full batch."""
    model.zero_grad(set_to_none=True)
    labels = batch["labels"].masked_fill(batch["attention_mask"] == 0, -100)
    out = model(**{**batch, "labels": labels}, use_cache=False)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), out.loss.detach(), grads


def sharded_forward(rank: int, world_size: int, kind: str, ulysses: int, ring: int, modes: list) -> list:
    """A switched fp64 model on ``ulysses x ring`` ranks against the unmodified one, for each vision
    mode in ``modes``: the largest differences of logits, loss and (context-summed) gradients."""
    import copy

    from hybridsp import init_mesh
    from hybridsp.integrations.transformers import apply

    model = tiny_vlm(kind, dtype=torch.float64)
    batch = mixed_batch(dtype=torch.float64)
    expected = reference(copy.deepcopy(model), batch)
    mesh = init_mesh(ulysses=ulysses, ring=ring)
    with apply(model, mesh, backend="reference"):
        return [_compare(model, batch, mesh, mode, expected) for mode in modes]


def _compare(model, batch: dict, mesh, mode: str, expected) -> dict:
    import torch.distributed as dist

    from hybridsp import gather_sequence, sharded_cross_entropy
    from hybridsp.integrations.transformers._vision.batch import shard_vlm_batch

    logits_ref, loss_ref, grads_ref = expected
    local = shard_vlm_batch(batch, mesh, model, vision=mode)
    labels, documents = local.pop("shift_labels"), local.pop("documents")
    logits = model(**local, hybridsp_documents=documents, use_cache=False).logits  # [B, S_pad / C, V]
    loss = sharded_cross_entropy(logits, labels, mesh)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad, group=mesh.context_group)
        grads[name] = grad
    model.zero_grad(set_to_none=True)
    full = gather_sequence(logits.detach(), mesh)[:, : batch["input_ids"].shape[1]]  # [B, S, V]
    real = batch["attention_mask"].bool()
    return {
        "logits": float((full - logits_ref)[real].abs().max()),
        "loss": abs(float(loss.detach()) - float(loss_ref)),
        "grad": max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in grads_ref.items()),
        "vision_grads": sum(1 for n in grads_ref if "visual" in n),
    }


def prompt_batch(seed: int = 3, dtype=torch.float32) -> dict:
    """Two unpadded prompt rows of equal length with images and a video (for generate)."""
    generator = torch.Generator().manual_seed(seed)
    first = [4, ("image", (1, 4, 4)), 6, ("video", (2, 4, 4)), 5]  # 4 + 6 + 6 + 10 + 5 = 31 tokens
    second = [2, ("image", (1, 4, 6)), 3, ("image", (1, 2, 4)), 12]  # 2 + 8 + 3 + 4 + 12 = 29 tokens
    batch = collate([sample(generator, first, dtype), sample(generator, second + [2], dtype)])
    assert bool(batch["attention_mask"].all())
    return {key: value for key, value in batch.items() if key not in ("labels", "attention_mask")}


def generate_matches(rank: int, world_size: int, kind: str, ulysses: int, ring: int, new_tokens: int) -> dict:
    """``generate_vlm`` on a switched model against ``model.generate`` of the unmodified one (greedy)."""
    import copy

    from hybridsp import init_mesh
    from hybridsp.integrations.transformers import apply
    from hybridsp.integrations.transformers._vision.generation import generate_vlm

    model = tiny_vlm(kind).eval()
    batch = prompt_batch()
    plain = copy.deepcopy(model)
    expected = plain.generate(**batch, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None)
    mesh = init_mesh(ulysses=ulysses, ring=ring)
    with apply(model, mesh, backend="reference"):
        ids = generate_vlm(model, batch, mesh=mesh, max_new_tokens=new_tokens, eos_token_id=[])
    return {"ours": ids.tolist(), "expected": expected.tolist()}
