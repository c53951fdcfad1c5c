"""GRPO / RLOO scoring at a long completion: memory per rank against one process.

    python -m benchmarks run memory.rl_scoring --completion 2048 --prompt 256   # the committed run: 21 min at load 15-50
    python -m benchmarks run memory.rl_scoring --completion 512 --prompt 128 --repeats 1 --out /tmp/rl   # ~4 min

The default (prompt 512 + completion 8192) needs ~17 GiB on one process: a bigger machine.

The scoring pass of TRL's GRPO/RLOO loss step, as ``HybridGRPOTrainer`` runs it: 2 rows of a
left-padded prompt (``--prompt`` tokens, the second row 64 shorter) and a right-padded completion
(``--completion`` tokens, the second row 128 shorter), a small untrained Llama (hidden 256, 4
layers, 8 query / 4 K/V heads, vocabulary 32000, fp32) with TRL's fused LM head
(``add_fused_lm_head``: per-token log-probs and entropies without the ``[B, S, V]`` logits):
the policy's per-token log-probs and entropies with gradient, a clipped GRPO-style loss over the
completion tokens and its backward, plus the reference model's no-grad scoring of the same rows.
Configurations, each in a fresh set of gloo ranks:

- ``plain``: TRL's own call on one process (the model's ``sdpa`` attention with the padding mask);
- ``hybridsp C=1``: the hybrid path on one rank (``right_aligned`` rows, ``shard_fused_calls``,
  hybridsp's attention), which separates the kernel's memory from the sharding's;
- ``U2xR1`` (2 ranks), ``U2xR2`` (4 ranks): the same, sharded.

Measured per rank with torch's allocation events (``harness.Allocations``: the peak of the
bytes allocated inside the block live at once; the models, made before, are not counted), the
max over ranks, the median of ``--repeats`` runs (configurations interleaved). The per-token
log-probs agree with the plain call (max abs difference reported). Writes
``benchmarks/results/rl/rl_scoring.{md,json}`` (``--out PREFIX`` elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.common import harness

CONFIGS = {"plain": (1, None), "hybridsp C=1": (1, (1, 1)), "U2xR1": (2, (2, 1)), "U2xR2": (4, (2, 2))}
MIB = 2**20


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=65536,
        attn_implementation="sdpa",
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def _rows(prompt: int, completion: int):
    """TRL's layout: [prompt left-padded | completion right-padded], ids [2, P + C], mask [2, P + C]."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (2, prompt + completion), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :64] = 0  # the shorter prompt
    mask[1, prompt + completion - 128 :] = 0  # the shorter completion
    return ids.masked_fill(mask == 0, 0), mask


def _score(model, ids, mask, completion: int, hybrid: bool, grad: bool):
    """Per-token log-probs and entropies [2, C] of the completion tokens, TRL's way or hybridsp's."""
    from hybridsp.integrations.trl._rollouts import right_aligned

    with torch.set_grad_enabled(grad):
        if hybrid:
            rolled, rolled_mask, labels, index = right_aligned(ids, mask, completion)
            out = model(input_ids=rolled, attention_mask=rolled_mask, labels=labels, fused_lm_head=True)
            return out.log_probs.gather(1, index), out.entropy.gather(1, index)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-completion] = -100
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        return out.log_probs[:, -completion:], out.entropy[:, -completion:]


def _measure(rank: int, world: int, degrees, prompt: int, completion: int) -> dict:
    from hybridsp import init_mesh
    from hybridsp.integrations.transformers import apply
    from hybridsp.integrations.trl._logprobs import shard_fused_calls

    policy, reference = _model(0), _model(0)
    ids, mask = _rows(prompt, completion)
    keep = mask[:, -completion:].float()  # [2, C]
    if degrees is not None:
        mesh = init_mesh(ulysses=degrees[0], ring=degrees[1])
        for model in (policy, reference):
            apply(model, mesh)
            shard_fused_calls(model, mesh)
    advantages = torch.tensor([[0.5], [-0.5]])
    with harness.Allocations() as memory:
        ref_logps, _ = _score(reference, ids, mask, completion, degrees is not None, grad=False)
        logps, entropy = _score(policy, ids, mask, completion, degrees is not None, grad=True)
        ratio = torch.exp(logps - logps.detach())
        per_token = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        loss = ((per_token + 0.04 * kl) * keep).sum() / keep.sum()
        loss.backward()
    return {"peak_mib": memory.peak / MIB, "logps": logps.detach()[0, :256].tolist(), "loss": float(loss.detach())}


def run(args) -> dict:
    rows = {name: [] for name in CONFIGS}
    reference = {}
    for repeat in range(args.repeats):
        names = list(CONFIGS)
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            world, degrees = CONFIGS[name]
            results = harness.launch(_measure, world, degrees, args.prompt, args.completion, timeout=3000)
            rows[name].append(max(r["peak_mib"] for r in results))
            reference.setdefault(name, results[0])
            print(
                f"  repeat {repeat + 1} {name}: {rows[name][-1]:.1f} MiB per rank (load {harness.load()})", flush=True
            )
    plain = reference["plain"]["logps"]
    table = {}
    for name, peaks in rows.items():
        diff = max(abs(a - b) for a, b in zip(reference[name]["logps"], plain))
        table[name] = {
            "world": CONFIGS[name][0],
            "peaks_mib": peaks,
            "median_mib": statistics.median(peaks),
            "logp_max_abs_diff": diff,
            "loss": reference[name]["loss"],
        }
    for row in table.values():
        row["vs_plain"] = row["median_mib"] / table["plain"]["median_mib"]
        row["vs_hybridsp_c1"] = row["median_mib"] / table["hybridsp C=1"]["median_mib"]
    return table


def markdown(table: dict, args, load_before: str, load_after: str) -> str:
    lines = [
        f"# GRPO/RLOO scoring pass: memory per rank (prompt {args.prompt} + completion {args.completion} tokens, "
        f"B = 2, V = 32000, fp32)",
        "",
        f"{harness.machine_info()}; {harness.software_info('transformers', 'trl')}; hybridsp {harness.revision()}; "
        f"load before {load_before}, after {load_after}; median of {args.repeats} run(s).",
        "",
        "| configuration | ranks | peak MiB per rank (median) | / plain | / hybridsp C=1 | max abs logp diff vs plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        lines.append(
            f"| {name} | {row['world']} | {row['median_mib']:.1f} | {row['vs_plain']:.3f} | "
            f"{row['vs_hybridsp_c1']:.3f} | {row['logp_max_abs_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=harness.results_path("rl", "rl_scoring"))
    args = parser.parse_args(argv)
    load_before = harness.load()
    table = run(args)
    report = markdown(table, args, load_before, harness.load())
    print(report)
    harness.write_results(args.out, report, {"args": vars(args), "table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
