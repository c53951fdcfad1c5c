"""The planner's answer for Llama-3-8B on H100 clusters (modelled, not measured): the ablation and the peak.

    python -m benchmarks run longest.planner_ablation              # 8, 32 and 64 H100 (about a minute)
    python -m benchmarks run longest.planner_ablation --nodes 1 --out /tmp/ablation

For each cluster of ``--nodes`` (8 H100 per node) it runs the planner's command line
``python -m hybridsp plan --model llama3-8b --gpu h100 --nodes N --gpus-per-node 8 --longest-context
--ablation --lean-norms --head-chunks auto`` (fused loss, tiled MLP, activation offload and optimizer
offload added one at a time; each row the longest S, a multiple of 1,024, that some DP x U x R x ZeRO x
checkpointing x G plan fits, with every memory term of that plan), and for the first cluster the
recommended plan with every technique on, ``--breakdown`` (where every GiB goes at its peak). The same
process that users run, so the file says exactly what the command says. Writes
``results/planner/ablation_planner.{md,json}`` (or ``--out``.{md,json}).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import harness

ARCTIC = {
    1: "3.7M (ablation on 8 GPUs: 1.1M Ulysses + Liger loss, 1.2M + tiled MLP, 2.4M + activation offload, "
    "3.8M with both)",
    4: "15M",
}  # Arctic Long Sequence Training's reported longest contexts
COMMON = ("--model", "llama3-8b", "--gpu", "h100", "--gpus-per-node", "8", "--longest-context", "--lean-norms",
          "--head-chunks", "auto")  # fmt: skip
EVERY_TECHNIQUE = ("--fused-loss", "--tiled-mlp", "--offload-activations", "--offload-optimizer", "--breakdown")


def plan(*options: str) -> str:
    """Standard output of ``python -m hybridsp plan`` with ``options`` (raises on a failed run)."""
    done = subprocess.run(
        [sys.executable, "-m", "hybridsp", "plan", *options], capture_output=True, text=True, check=True
    )
    return done.stdout


def cluster_section(nodes: int) -> tuple[str, dict]:
    """One cluster's ablation, one planner run: (its markdown section, its JSON rows)."""
    with tempfile.TemporaryDirectory() as folder:
        written = Path(folder) / "ablation.json"
        table = plan(*COMMON, "--nodes", str(nodes), "--ablation", "--out", str(written)).strip()
        rows = json.loads(written.read_text())["ablation"]
    title = (
        f"## {8 * nodes} H100 ({nodes} node{'s' if nodes > 1 else ''}); Arctic/ALST measured: {ARCTIC.get(nodes, '-')}"
    )
    return f"{title}\n\n{table}\n", {"nodes": nodes, "gpus": 8 * nodes, "rows": rows}


def peak_section(nodes: int) -> str:
    """The recommended plan with every technique on, and its memory at the peak, term by term."""
    text = plan(*COMMON, "--nodes", str(nodes), *EVERY_TECHNIQUE)
    start = text.index("Recommended:")
    return f"## The peak of the {8 * nodes}-GPU plan with every technique\n\n```\n{text[start:].strip()}\n```\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", nargs="+", type=int, default=[1, 4, 8], help="clusters: nodes of 8 H100")
    parser.add_argument("--out", help="write <out>.{md,json} instead of results/planner/ablation_planner")
    args = parser.parse_args(argv)
    sections, clusters = [], []
    for nodes in args.nodes:
        section, rows = cluster_section(nodes)
        sections.append(section)
        clusters.append(rows)
        print(f"  {8 * nodes} H100: {rows['rows'][-1]['longest_context']:,} tokens with every technique", flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    command = "python -m benchmarks run longest.planner_ablation " + " ".join(argv or [])
    head = [
        "# The planner's ablation: Llama-3-8B on H100 (modelled)",
        "",
        f"- Date: {date}; command: `{command.strip()}`; each section is the output of "
        f"`python -m hybridsp plan {' '.join(COMMON)} --nodes N --ablation`.",
        "- Planner defaults: bf16, micro-batch 1, 50% of peak FLOP/s, 4 GiB reserved per GPU, 2 TiB host memory "
        "per node, PCIe 64 GB/s per GPU, lean norms, head chunks chosen by the planner. Modelled, not measured.",
        "",
    ]
    text = "\n".join(head) + "\n" + "\n".join(sections) + "\n" + peak_section(args.nodes[0])
    prefix = args.out or harness.results_path("planner", "ablation_planner")
    with open(f"{prefix}.md", "w") as sink:
        sink.write(text)
    with open(f"{prefix}.json", "w") as sink:
        json.dump({"date": date, "command": command.strip(), "clusters": clusters}, sink, indent=1)
        sink.write("\n")
    print(f"wrote {prefix}.md and {prefix}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
