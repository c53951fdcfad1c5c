"""Per-rank parameter and activation memory with tensor parallelism at a fixed context size C.

    python -m benchmarks run memory.tensor_parallel [--seq 2048] [--context 2] [--out PREFIX]

For T = 1, 2, 4 (world = T x C, C = U = 2 Ulysses ranks) a small Llama (hidden 512, 8 heads, 4 K/V
heads, MLP 2048, 2 layers, fp32) runs one forward on one sequence of ``--seq`` tokens, with and
without Megatron-style sequence parallelism inside the tensor group. Measured on rank 0:

- parameter bytes (the module's parameters after :func:`tensor_parallel`);
- activation bytes: every tensor autograd saves for the backward during the forward (counted with
  ``torch.autograd.graph.saved_tensors_hooks``, each storage once) - what a training step holds
  at the end of its forward, independent of allocator noise;
- the part of it saved by the norms (RMSNorm: the region Megatron's SP divides by T).

Writes ``benchmarks/results/tensor_parallel/tensor_memory.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common.harness import launch, machine_info, results_path, revision, write_results

SHAPE = dict(
    vocab_size=256,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=8192,
    attn_implementation="sdpa",
)


class SavedBytes:
    """Bytes of the distinct storages autograd saves while active; ``norm`` those saved inside RMSNorms."""

    def __init__(self):
        self.seen, self.total, self.norm, self.in_norm = set(), 0, 0, 0

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and storage.nbytes() > 0:
            self.seen.add(key)
            self.total += storage.nbytes()
            self.norm += storage.nbytes() if self.in_norm else 0
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _measure(rank, world, seq, context, sequence_parallel):
    import transformers

    from hybridsp import init_mesh, shard_batch
    from hybridsp.integrations import transformers as hf

    tensor = world // context
    mesh = init_mesh(ulysses=context, ring=1, tensor=tensor)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).float()
    hf.tensor_parallel(model, mesh, sequence_parallel=sequence_parallel and tensor > 1)
    hf.apply(model, mesh, backend="torch")
    counter = SavedBytes()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.register_forward_pre_hook(lambda *_: setattr(counter, "in_norm", 1))
            module.register_forward_hook(lambda *_: setattr(counter, "in_norm", 0))
    ids = torch.randint(1, SHAPE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    local = shard_batch({"input_ids": ids, "labels": ids}, mesh)
    with counter.hooks():
        hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    layer_params = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." in n)
    return dict(
        T=tensor,
        C=context,
        sp=sequence_parallel and tensor > 1,
        params=params,
        layer_params=layer_params,
        activations=counter.total,
        norm_activations=counter.norm,
        hidden_shape=list(hidden.shape),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--context", type=int, default=2)
    parser.add_argument(
        "--out",
        default=results_path("tensor_parallel", "tensor_memory"),
        help="output prefix (default benchmarks/results/tensor_parallel/tensor_memory)",
    )
    args = parser.parse_args(argv)
    rows = []
    for tensor in (1, 2, 4):
        for sp in (False,) if tensor == 1 else (False, True):
            rows.append(launch(_measure, tensor * args.context, args.seq, args.context, sp, timeout=900)[0])
            print(rows[-1], flush=True)
    base = rows[0]
    lines = [
        f"Per-rank memory, Llama {SHAPE['hidden_size']}h x {SHAPE['num_hidden_layers']} layers fp32, one "
        f"sequence of {args.seq} tokens, C = U = {args.context}, rank 0 (`memory.tensor_parallel`).",
        "",
        "| T | SP in tensor group | parameters MiB | layer params MiB | activations saved MiB | of which norms MiB"
        " | activations vs T=1 |",
        "|---|---|---|---|---|---|---|",
    ]
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    for row in rows:
        lines.append(
            f"| {row['T']} | {'yes' if row['sp'] else 'no'} | {mib(row['params'])} | {mib(row['layer_params'])}"
            f" | {mib(row['activations'])} | {mib(row['norm_activations'])} | "
            f"{row['activations'] / base['activations']:.2f} |"
        )
    lines += ["", machine_info(), f"revision {revision()}"]
    write_results(
        args.out, "\n".join(lines) + "\n", {"rows": rows, "seq": args.seq, "context": args.context, "shape": SHAPE}
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
