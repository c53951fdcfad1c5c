"""A long video as ONE sharded sequence: score it and train a few steps of a tiny Qwen2-VL on CPU ranks.

    torchrun --nproc-per-node 4 examples/long_video.py --ulysses 2 --ring 2 --frames 128 --steps 3

Nothing is downloaded: the frames are drawn here (a bright square moving over a colour
gradient; ``--frames`` frames of ``--size`` x ``--size`` pixels), cut into Qwen2-VL patches the
way its image processor lays them out (2 frames x 14 x 14 pixels per patch, 2 x 2 patches per
token), and the model is a small *untrained* Qwen2-VL built from a config (random weights: the
point is the mechanics). The sequence is ``<question> <vision_start> <video tokens>
<vision_end> <answer>``; the loss is on the text tokens.

1. **Scoring**: one sharded forward under ``torch.inference_mode()``: the video's frames are
   encoded by the ranks that hold their tokens (``--vision local``) or split evenly over the ranks
   (``--vision split``), the language model runs hybrid Ulysses x ring attention over the
   whole sequence. Rank 0 prints the loss and the peak memory of every rank.
2. **Training**: ``--steps`` AdamW steps on the same sequence; every rank back-propagates its
   own tokens and the gradients are summed over the context group (what DeepSpeed does for
   ``HybridSPTrainer``).

User errors (sizes the patches cannot tile, degrees that do not divide the ranks or the heads)
are reported as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from progress import layer_progress  # noqa: E402

PATCH, TEMPORAL, MERGE = 14, 2, 2
VOCAB, IMAGE, VIDEO, START, END = 256, 250, 251, 252, 253


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=64, help="video frames (a multiple of 2; default 64)")
    parser.add_argument("--size", type=int, default=112, help="frame height and width in pixels (multiple of 28)")
    parser.add_argument("--ulysses", type=int, help="Ulysses degree (default: all ranks / --ring)")
    parser.add_argument("--ring", type=int, default=1, help="ring degree (default 1)")
    parser.add_argument("--vision", choices=("local", "split"), default="local", help="who encodes which frames")
    parser.add_argument("--steps", type=int, default=3, help="training steps after scoring (default 3)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=1800.0,
        help="seconds a collective may wait before the rank fails (default 1800: one ring step of a long CPU prefill can take minutes)",
    )
    args = parser.parse_args(argv)
    if not args.collective_timeout > 0:
        parser.error(f"--collective-timeout must be a positive number of seconds; got {args.collective_timeout}")
    if args.frames < TEMPORAL or args.frames % TEMPORAL:
        parser.error(f"--frames must be a positive multiple of {TEMPORAL}; got {args.frames}")
    if args.size < PATCH * MERGE or args.size % (PATCH * MERGE):
        parser.error(f"--size must be a positive multiple of {PATCH * MERGE} pixels; got {args.size}")
    if args.steps < 0:
        parser.error(f"--steps must be >= 0; got {args.steps}")
    return args


def draw_frames(count: int, size: int) -> torch.Tensor:
    """[T, 3, size, size] floats in [0, 1]: a colour gradient with a square moving across it."""
    y, x = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    frames = torch.stack([x, y, 1 - x], dim=0).expand(count, 3, size, size).clone()  # [T, 3, size, size]
    side = size // 4
    for t in range(count):
        left = (t * size // max(count, 1)) % (size - side)
        frames[t, :, side : 2 * side, left : left + side] = 1.0
    return frames


def frames_to_patches(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 3, H, W] -> (pixel_values_videos [t * h * w, 3 * 2 * 14 * 14], video_grid_thw [1, 3]).

    The order of Qwen2-VL's processor: temporal patch, then 2 x 2 merge blocks row by row,
    then the patches inside a block, each patch flattened as (channel, frame, row, column).
    """
    count, channels, height, width = frames.shape
    t, h, w = count // TEMPORAL, height // PATCH, width // PATCH
    patches = frames.reshape(t, TEMPORAL, channels, h // MERGE, MERGE, PATCH, w // MERGE, MERGE, PATCH)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, h/m, w/m, m, m, C, 2, p, p]
    return patches.reshape(t * h * w, channels * TEMPORAL * PATCH * PATCH), torch.tensor([[t, h, w]])


def build_model():
    """A small untrained Qwen2-VL: 4 language layers (hidden 128, 4 heads), 2 vision blocks."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=65536,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=64,
            hidden_size=128,
            num_heads=2,
            mlp_ratio=2,
            patch_size=PATCH,
            temporal_patch_size=TEMPORAL,
            spatial_merge_size=MERGE,
        ),
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        attn_implementation="sdpa",
    )
    return Qwen2VLForConditionalGeneration(config)


def make_batch(frames: int, size: int) -> dict:
    """One row: question, the video's tokens, answer (byte ids below 250); labels on the text."""
    pixels, grid = frames_to_patches(draw_frames(frames, size))
    question = torch.tensor(list(b"Where does the white square go in this video? "))
    answer = torch.tensor(list(b"It moves from left to right, then starts again."))
    tokens = int(grid.prod()) // MERGE**2
    ids = torch.cat([question, torch.tensor([START] + [VIDEO] * tokens + [END]), answer])[None]  # [1, S]
    labels = ids.masked_fill(ids >= IMAGE, -100)
    types = 2 * (ids == VIDEO).int()  # [1, S] what the processor returns: 0 text, 1 image, 2 video
    return {
        "input_ids": ids,
        "labels": labels,
        "pixel_values_videos": pixels,
        "video_grid_thw": grid,
        "mm_token_type_ids": types,
    }


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(args: argparse.Namespace) -> dict:
    from hybridsp import init_mesh, sharded_cross_entropy
    from hybridsp.integrations.transformers import apply, shard_vlm_batch

    world = dist.get_world_size()
    ulysses = args.ulysses or max(world // args.ring, 1)
    if ulysses * args.ring != world:
        raise ValueError(f"--ulysses {ulysses} x --ring {args.ring} must equal the {world} ranks")
    model = build_model()
    mesh = init_mesh(ulysses, args.ring)
    apply(model, mesh)
    batch = make_batch(args.frames, args.size)
    local = shard_vlm_batch(batch, mesh, model, vision=args.vision)
    labels, documents = local.pop("shift_labels"), local.pop("documents")
    started = time.perf_counter()
    with (
        torch.inference_mode(),
        layer_progress(model, f"score {batch['input_ids'].shape[1]:,} tokens", enabled=mesh.rank == 0),
    ):
        score = float(
            sharded_cross_entropy(model(**local, hybridsp_documents=documents, use_cache=False).logits, labels, mesh)
        )
    scored = time.perf_counter() - started
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        loss = sharded_cross_entropy(model(**local, hybridsp_documents=documents, use_cache=False).logits, labels, mesh)
        loss.backward()
        for parameter in model.parameters():  # sum of the ranks' shares = the unsharded gradient
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=mesh.context_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_rss_bytes())
    return {
        "tokens": int(batch["input_ids"].shape[1]),
        "video_tokens": int((batch["input_ids"] == VIDEO).sum()),
        "patches": int(batch["pixel_values_videos"].shape[0]),
        "mesh": repr(mesh),
        "score": score,
        "score_seconds": scored,
        "losses": losses,
        "peak_rss_bytes_per_rank": peaks,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from hybridsp.launch import init_process_group

    init_process_group(
        args.collective_timeout, backend="gloo"
    )  # CPU only; a world of one without a launcher; adopts an existing group
    try:
        result = run(args)
    except ValueError as error:
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from error
    if dist.get_rank() == 0:
        print(
            f"{args.frames} frames -> {result['video_tokens']:,} video "
            f"tokens in a {result['tokens']:,}-token sequence over {result['mesh']}: score {result['score']:.4f} "
            f"nats/token ({result['score_seconds']:.1f} s); training losses "
            f"{', '.join(f'{x:.4f}' for x in result['losses'])}; peak RSS per rank "
            f"{', '.join(f'{b / 2**20:,.0f}' for b in result['peak_rss_bytes_per_rank'])} MiB",
            flush=True,
        )
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    dist.destroy_process_group()
