"""Check where the mesh's ranks run before a long job: hosts, ranks per host, groups.

Run it with the launcher and the degrees of the real job, e.g.

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE --master-addr $HEAD --master-port 29500 \\
        -m hybridsp check-mesh --ulysses 8 --ring 2
    deepspeed --hostfile hostfile --no_local_rank --module hybridsp check-mesh --ulysses 8 --ring 2

Every rank initialises the process group (gloo on CPU, NCCL on GPUs; the gloo interface as in
hybridsp.launch._gloo_interface), builds the mesh and reports its host; rank 0 prints what the launcher said
(hybridsp.launch._launcher), one placement line (hybridsp.mesh._placement) and the time of one all-reduce
over a Ulysses group and over a ring group. Exit status 1 when a Ulysses group crosses hosts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

HELP = "check rank placement (hosts, ranks, Ulysses and ring groups) under the real launcher"


def _degree(text: str) -> int | str:
    return text if text == "auto" else int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ulysses", type=_degree, default="auto", help="Ulysses degree (default: auto)")
    parser.add_argument("--ring", type=_degree, default="auto", help="ring degree (default: auto)")
    parser.add_argument("--heads", type=int, help="query heads of the model (needed for 'auto' degrees)")
    parser.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds (default 120)")


def _all_reduce_ms(group, numel: int = 2**18) -> float:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    tensor = torch.ones(numel, device=device)
    dist.all_reduce(tensor, group=group)  # warm-up: connect
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from hybridsp.launch._gloo_interface import choose_gloo_interface
    from hybridsp.launch._launcher import read_launch_env
    from hybridsp.mesh._hybrid_mesh import init_mesh
    from hybridsp.mesh._placement import gather_placement

    if "WORLD_SIZE" not in os.environ:
        print(
            "check-mesh: error: run it under the job's launcher (torchrun, deepspeed, srun), not alone", file=sys.stderr
        )
        return 2
    interface = choose_gloo_interface()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(seconds=args.timeout)
    )
    try:
        try:
            mesh = init_mesh(args.ulysses, args.ring, num_heads=args.heads)
        except ValueError as error:  # raised on every rank before any collective
            if dist.get_rank() == 0:
                print(f"check-mesh: error: {error}", file=sys.stderr)
            return 2
        placement = gather_placement(mesh)
        ulysses_ms, ring_ms = _all_reduce_ms(mesh.ulysses_group), _all_reduce_ms(mesh.ring_group)
        if mesh.rank == 0:
            env = read_launch_env()
            print(
                f"launcher: {env.launcher}, {env.world_size} ranks, {env.local_world_size} per node, "
                f"gloo interface {interface or 'gloo default'}; mesh DP {mesh.dp} x ring {mesh.ring} x "
                f"Ulysses {mesh.ulysses}"
            )
            print(placement.describe())
            print(f"all-reduce of 1 MiB: {ulysses_ms:.1f} ms over a Ulysses group, {ring_ms:.1f} ms over a ring group")
        return 1 if placement.ulysses_crossing_hosts() else 0
    finally:
        dist.destroy_process_group()
