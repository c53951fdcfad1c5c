"""Train a small video diffusion transformer (diffusers' Wan 2.x architecture) with hybrid Ulysses x ring.

    torchrun --nproc-per-node 2 examples/train_video_dit.py --ulysses 2 --ring 1 --steps 30

A random tiny ``WanTransformer3DModel`` (no download) learns synthetic clips (a bright square moving
across the frames) with the flow-matching loss of diffusers' training examples; the transformer is
switched by ``hybridsp.integrations.diffusers.apply`` (each rank holds 1/C of the video tokens) and
sharded by torch's ``fully_shard`` over the world. Rank 0 shows a progress bar, writes
``metrics.jsonl`` and draws ``video_dit.png``: the loss curve and, for one clip, its frames next to
the model's one-step denoised estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from console import quiet_console  # noqa: E402
from host import end_rank_on_error, share_cpu_cores  # noqa: E402


def clips(batch: int, frames: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """[B, 4, F, size, size] latents: a square moving left to right, at a random row, on noise-free ground."""
    video = torch.full((batch, 4, frames, size, size), -1.0)
    for b in range(batch):
        row = int(torch.randint(0, size - 3, (1,), generator=generator))
        for f in range(frames):
            col = (f * (size - 3)) // max(1, frames - 1)
            video[b, :, f, row : row + 3, col : col + 3] = 1.0
    return video


def flow_matching_loss(model, latents, text, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, sigma [B], one-step x0 estimate) of diffusers' rectified-flow objective."""
    noise = torch.randn(latents.shape, generator=generator)
    sigma = torch.rand(latents.shape[0], generator=generator)
    s = sigma.view(-1, 1, 1, 1, 1)
    noisy = (1 - s) * latents + s * noise
    velocity = model(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=text).sample
    loss = torch.nn.functional.mse_loss(velocity.float(), (noise - latents).float())
    return loss, sigma, (noisy - s * velocity).detach()


def draw(path: Path, losses: list[float], clip: torch.Tensor, estimate: torch.Tensor, sigma: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = clip.shape[1]
    figure, axes = plt.subplots(3, frames, figsize=(1.6 * frames, 5.2), squeeze=False)
    grid = figure.add_gridspec(3, frames)
    for ax in axes[0]:
        ax.remove()
    curve = figure.add_subplot(grid[0, :])
    curve.plot(losses)
    curve.set(xlabel="step", ylabel="flow-matching loss", yscale="log")
    for f in range(frames):
        for row, (video, title) in enumerate(((clip, "clip"), (estimate, f"x0 estimate (sigma {sigma:.2f})")), 1):
            axes[row][f].imshow(video[0, f].numpy(), vmin=-1.5, vmax=1.5, cmap="gray")
            axes[row][f].set_axis_off()
            if f == 0:
                axes[row][f].set_title(title, fontsize=8, loc="left")
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ulysses", type=int, default=1)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--frames", type=int, default=5)
    parser.add_argument("--size", type=int, default=12, help="latent height and width (tokens: frames x size^2 / 4)")
    parser.add_argument("--out", default="runs/video_dit")
    args = parser.parse_args(argv)
    share_cpu_cores()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with quiet_console(rank), end_rank_on_error():
        train(args, rank)
    dist.destroy_process_group()


def train(args: argparse.Namespace, rank: int) -> None:
    from diffusers import WanTransformer3DModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from tqdm import tqdm

    import hybridsp
    from hybridsp.integrations import diffusers as hybrid_diffusers

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64,
    )  # fmt: skip
    mesh = hybridsp.init_mesh(ulysses=args.ulysses, ring=args.ring, layout="contiguous")
    handle = hybrid_diffusers.apply(model, mesh)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)  # the same on every rank: full inputs everywhere
    text = torch.randn(2, 6, 32, generator=generator)
    losses: list[float] = []
    tokens = args.frames * (args.size // 2) ** 2
    with open(out / "metrics.jsonl", "w") as metrics:
        bar = tqdm(range(args.steps), disable=rank != 0, desc=f"train ({tokens} tokens, C={mesh.context})")
        for step in bar:
            latents = clips(2, args.frames, args.size, generator)
            loss, sigma, estimate = flow_matching_loss(model, latents, text, generator)
            (loss * mesh.context).backward()  # fully_shard averages; the context ranks' shares must add up
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if rank == 0:
                metrics.write(json.dumps({"step": step, "loss": losses[-1]}) + "\n")
    if rank == 0:
        draw(out / "video_dit.png", losses, latents[0], estimate[0], float(sigma[0]))
        print(f"wrote {out / 'metrics.jsonl'} and {out / 'video_dit.png'}")
    handle.undo()


if __name__ == "__main__":
    main()
