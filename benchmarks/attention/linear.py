"""One Gated DeltaNet layer (Qwen3.5's linear attention) under U x R against one process: bytes, memory, CPU time.

Question: what does exact state passing cost per linear layer and rank? For every mesh of four ranks
(U4xR1, U2xR2, U1xR4) and one process, a forward + backward of the same layer on the same input
(B=1, S tokens, hidden 256, 4 key / 8 value heads of 32):

- bytes each rank sends (hybridsp._comm.CommCounter, forward + backward) against
  hybridsp.linear_attention._volume's forward formulas, and the formulas' alternatives: gathering the sequence
  over the ring, and the whole context on the Ulysses axis;
- torch's allocated peak per rank over the call (harness.Allocations) against one process;
- CPU time of the call summed over ranks against one process (medians, interleaved with nothing
  else: each mesh runs in its own launch; the load is noted);
- the output's max relative error against the unmodified layer on one process.

Run: ``python -m benchmarks run attention.linear [--seq-len 4096] [--iters 5] [--out PREFIX]``
(~2-4 min on 2 cores). Writes results/linear/linear.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.common.harness import (
    Allocations,
    interleave,
    launch,
    load,
    machine_info,
    results_path,
    revision,
    write_results,
)

SHAPE = dict(
    hidden_size=256,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
)
MESHES = [(4, 1), (2, 2), (1, 4)]


def _layer():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        layer_types=["linear_attention"],
        **SHAPE,
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).float().model.layers[0].linear_attn


def _input(seq_len: int) -> torch.Tensor:
    return torch.randn(1, seq_len, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))  # [1, S, h]


def run(rank: int, world: int, ulysses: int, ring: int, seq_len: int, iters: int) -> dict:
    from hybridsp import init_mesh, shard_sequence
    from hybridsp._comm import CommCounter
    from hybridsp.integrations.transformers._linear_layers import switch_linear_layers

    layer, full = _layer(), _input(seq_len)
    with torch.no_grad():
        reference = layer(full)  # [1, S, h] the unmodified layer, this process
    mesh = init_mesh(ulysses=ulysses, ring=ring)
    if ulysses * ring > 1:
        switch_linear_layers(layer, mesh)
    local = shard_sequence(full, mesh) if world > 1 else full

    def step():
        x = local.clone().requires_grad_(True)
        layer(x).sum().backward()

    step()  # warm-up
    mesh.comm_counter = CommCounter()
    with Allocations() as allocated:
        step()
    counted = dict(mesh.comm_counter.bytes_sent)
    mesh.comm_counter = None
    times = interleave({"step": step}, iters)["step"]
    with torch.no_grad():
        out = layer(local)
    expected = shard_sequence(reference, mesh) if world > 1 else reference
    error = float((out - expected).abs().max() / expected.abs().max())
    return {"bytes": counted, "peak": allocated.peak, "cpu": times["cpu"], "wall": times["wall"], "error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=results_path("linear", "linear"), help="output prefix")
    args = parser.parse_args(argv)
    from hybridsp.linear_attention._volume import LinearLayerSpec, linear_layer_bytes

    spec = LinearLayerSpec("delta_rule", SHAPE["linear_num_key_heads"], SHAPE["linear_num_value_heads"], 32, 32, 4)
    loads = [load()]
    one = launch(run, 1, 1, 1, args.seq_len, args.iters)[0]
    rows, data = [], {"seq_len": args.seq_len, "one_process": one, "meshes": {}}
    for ulysses, ring in MESHES:
        ranks = launch(run, ulysses * ring, ulysses, ring, args.seq_len, args.iters)
        loads.append(load())
        formula = linear_layer_bytes(spec, 1, args.seq_len, ulysses, ring, element_bytes=4)
        sent = max(sum(r["bytes"].values()) for r in ranks)
        forward = max(r["bytes"].get("all_to_all", 0) // 2 + r["bytes"].get("linear_allgather", 0) for r in ranks)
        cpu = statistics.median(sum(r["cpu"][i] for r in ranks) for i in range(args.iters))
        peak = max(r["peak"] for r in ranks)
        name = f"U{ulysses}xR{ring}"
        data["meshes"][name] = {"ranks": ranks, "formula": formula}
        rows.append(
            f"| {name} | {forward / 2**10:.1f} | {formula['total'] / 2**10:.1f} | {sent / 2**10:.1f} | "
            f"{formula['gather_sequence'] / max(formula['total'], 1):.2f} | "
            f"{formula['ulysses_only'] / max(formula['total'], 1):.2f} | {peak / one['peak']:.3f} | "
            f"{cpu / statistics.median(one['cpu']):.2f} | {max(r['error'] for r in ranks):.1e} |"
        )
    data["loads"] = loads
    markdown = "\n".join(
        [
            f"# One Gated DeltaNet layer under U x R (B=1, S={args.seq_len}, hidden 256, Hk 4, Hv 8, dk = dv = 32, fp32)",
            "",
            f"{machine_info()}; revision {revision()}; load before/after each launch: {', '.join(loads)}",
            "",
            "| mesh | fwd KiB sent/rank (measured) | fwd KiB (formula) | fwd+bwd KiB sent/rank | gather-seq / ours "
            "| Ulysses-only / ours | peak alloc / one process | CPU (sum of ranks) / one process | max rel err |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"One process: peak {one['peak'] / 2**20:.1f} MiB, CPU median {statistics.median(one['cpu']):.3f} s.",
            "",
            "fwd measured = the all-gathers plus half the all-to-all bytes (forward and backward move the same all-to-all "
            "bytes); gather-seq / ours and Ulysses-only / ours are forward-byte ratios from hybridsp.linear_attention._volume "
            "(Ulysses-only needs C to divide the 4 key heads: only U4xR1 can run it).",
        ]
    )
    write_results(args.out, markdown + "\n", data)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
