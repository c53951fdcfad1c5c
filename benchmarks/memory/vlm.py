"""A long video as one sequence: memory per rank (vision encoder's share, language model's share)
against one process, and the two ways of dividing the vision encoder's work.

    python -m benchmarks run memory.vlm                 # ~10-20 min on 2 busy cores
    python -m benchmarks run memory.vlm --frames 64     # quicker

The model and the video are ``examples/long_video.py``'s (a small untrained Qwen2-VL: 4 language
layers, hidden 128; 2 vision blocks, embed 64; drawn frames of 224 x 224 pixels, 2 frames x 14 x 14
pixels per patch, 2 x 2 patches per token), fp32, in a fresh set of gloo ranks per world size
(1 = the unmodified model on one process, 2 = U2, 4 = U2 x R2). Measured with torch's own
allocation events (``harness.Allocations``: the peak of the bytes allocated inside the block
that were live at once), per rank, the max over ranks:

- ``vision``: the vision encoder's forward + backward alone on the frames this rank encodes
  (the unmodified model: all frames), its output's gradient a fixed random tensor;
- ``language``: the language model's forward + loss + backward with the vision features given
  (detached, as ``mm_encoder_outputs``) for this rank's tokens;
- ``step``: the whole training step (vision encoder, language model, loss, backward);
- ``pixels``: the bytes of the patches this rank holds for its encoder work.

Timing (U2 x R2): ``vision="local"`` and ``vision="split"`` interleaved (``harness.interleave``),
the vision encoder's forward + backward, for the long video (tokens spread over the sequence)
and for a batch whose 16 images all sit in the first quarter of the sequence.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.common import harness
from benchmarks.common.example import example as load_example

WORLDS = {1: (1, 1), 2: (2, 1), 4: (2, 2)}  # world -> (ulysses, ring)


def _images_first(example, count: int = 16, size: int = 224, text: int = 3000) -> dict:
    """``count`` images at the start of the sequence, then ``text`` tokens of text."""
    frame = example.draw_frames(1, size)[0]
    pixels, grid = example.frames_to_patches(torch.stack([frame, frame]))
    tokens = int(grid.prod()) // example.MERGE**2
    ids = torch.tensor(
        ([example.START] + [example.IMAGE] * tokens + [example.END]) * count + list(range(3, 200)) * (text // 197 + 1)
    )[None, : (tokens + 2) * count + text]  # [1, S]
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(ids >= example.IMAGE, -100),
        "pixel_values": pixels.repeat(count, 1),
        "image_grid_thw": grid.repeat(count, 1),
        "mm_token_type_ids": (ids == example.IMAGE).int(),
    }


def measure(rank: int, world: int, frames: int, size: int, iters: int) -> dict:
    example = load_example("long_video")
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from hybridsp import init_mesh, sharded_cross_entropy
    from hybridsp.integrations.transformers import apply
    from hybridsp.integrations.transformers._vision.batch import shard_vlm_batch
    from hybridsp.integrations.transformers._vision.model import encode_shard

    model, batch = example.build_model(), example.make_batch(frames, size)
    mesh = init_mesh(*WORLDS[world])
    apply(model, mesh, backend="torch")
    local = shard_vlm_batch(batch, mesh, model)
    labels, shard = local.pop("shift_labels"), local.pop("hybridsp_vision")
    local["hybridsp_documents"] = local.pop("documents")
    torch.manual_seed(rank)
    with torch.no_grad():
        features = encode_shard(model, shard, mesh)  # this rank's tokens' features
    cotangent = torch.randn_like(features["video"].pooler_output[0])

    def vision():
        encode_shard(model, shard, mesh)["video"].pooler_output[0].backward(cotangent)

    def language():
        given = {"video": BaseModelOutputWithPooling(pooler_output=(features["video"].pooler_output[0],))}
        sharded_cross_entropy(model(**local, mm_encoder_outputs=given, use_cache=False).logits, labels, mesh).backward()

    def step():
        out = model(**local, hybridsp_vision=shard, use_cache=False)
        sharded_cross_entropy(out.logits, labels, mesh).backward()

    result = {"pixels": shard.pixels.numel() * shard.pixels.element_size(), "tokens": int(batch["input_ids"].shape[1])}
    for name, block in (("vision", vision), ("language", language), ("step", step)):
        block()  # warm-up: first-call allocations (thread pools, caches) are not the model's
        model.zero_grad(set_to_none=True)
        with harness.Allocations() as allocations:
            block()
        model.zero_grad(set_to_none=True)
        result[name] = allocations.peak
    if world == 4:
        result["timing"] = _vision_modes(
            model, mesh, {"long video": batch, "images first": _images_first(example)}, iters
        )
    return result


def _vision_modes(model, mesh, batches: dict, iters: int) -> dict:
    """Per batch: the vision encoder's forward + backward per mode, interleaved; patches per rank."""
    from hybridsp.integrations.transformers._vision.batch import shard_vlm_batch
    from hybridsp.integrations.transformers._vision.model import encode_shard

    timings = {}
    for label, batch in batches.items():
        calls, patches = {}, {}
        for mode in ("local", "split"):
            shard = shard_vlm_batch(batch, mesh, model, vision=mode)["hybridsp_vision"]
            patches[mode] = int(shard.pixels.shape[0])

            def call(shard=shard):
                outputs = encode_shard(model, shard, mesh)
                sum(o.pooler_output[0].sum() for o in outputs.values()).backward()
                model.zero_grad(set_to_none=True)

            calls[mode] = call
        timings[label] = {"times": harness.interleave(calls, iters), "patches": patches}
    return timings


def report(results: dict[int, list[dict]], frames: int, size: int) -> tuple[str, dict]:
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    one = results[1][0]
    lines = [
        f"Long video: {frames} frames of {size} x {size} -> {one['tokens']:,} tokens "
        f"(examples/long_video.py's model, fp32). Peak torch allocations per rank (max over ranks), MiB:",
        "",
        "| ranks | mesh | vision encoder | language model | whole step | pixels held |",
        "|---|---|---|---|---|---|",
    ]
    data = {"frames": frames, "size": size, "rows": []}
    for world, ranks in results.items():
        row = {key: max(r[key] for r in ranks) for key in ("vision", "language", "step", "pixels")}
        mesh = "one process (C = 1)" if world == 1 else "U%d x R%d" % WORLDS[world]
        lines.append(
            f"| {world} | {mesh} | {mib(row['vision'])} | {mib(row['language'])} | {mib(row['step'])} | "
            f"{mib(row['pixels'])} |"
        )
        data["rows"].append({"world": world, "mesh": mesh, **row})
    timing = results[4][0].get("timing", {})
    lines += [
        "",
        "Vision encoder forward + backward at U2 x R2: median over iterations of the busiest rank's CPU "
        "seconds (what bounds a step when every rank has its own device) and of the wall time (max over "
        "ranks; 4 ranks share the cores here), and the patches each rank encodes:",
        "",
        "| batch | busiest rank CPU s, local | split | wall s, local | split | patches local | patches split |",
        "|---|---|---|---|---|---|---|",
    ]
    for label in timing:
        times = {mode: [r["timing"][label]["times"][mode] for r in results[4]] for mode in ("local", "split")}
        busiest = {
            mode: statistics.median(max(r["cpu"][i] for r in ranks) for i in range(len(ranks[0]["cpu"])))
            for mode, ranks in times.items()
        }
        wall = {mode: harness.combine(ranks)["median_wall"] for mode, ranks in times.items()}
        patches = {mode: [r["timing"][label]["patches"][mode] for r in results[4]] for mode in ("local", "split")}
        lines.append(
            f"| {label} | {busiest['local']:.3f} | {busiest['split']:.3f} | {wall['local']:.3f} | "
            f"{wall['split']:.3f} | {patches['local']} | {patches['split']} |"
        )
        data.setdefault("timing", {})[label] = {"busiest_rank_cpu": busiest, "median_wall": wall, "patches": patches}
    lines += [
        "",
        f"Machine: {harness.machine_info()}; load {harness.load()}; {harness.software_info()}; "
        f"hybridsp {harness.revision()}.",
    ]
    return "\n".join(lines) + "\n", data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", default=harness.results_path("vlm", "vlm_memory"), help="output prefix")
    args = parser.parse_args(argv)
    results = {
        world: harness.launch(measure, world, args.frames, args.size, args.iters, timeout=1800) for world in WORLDS
    }
    markdown, data = report(results, args.frames, args.size)
    print(markdown)
    harness.write_results(args.out, markdown, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
