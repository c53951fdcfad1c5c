"""The planner's ablation for Llama-3-8B on H100 clusters: longest context as techniques are added.

    python benchmarks/predict_ablation.py        # 8, 32 and 64 H100 (1, 4, 8 nodes); a few seconds

For each cluster ``hybridsp.planner.ablation`` (the same as ``python -m hybridsp plan --model
llama3-8b --gpu h100 --nodes N --gpus-per-node 8 --longest-context --ablation``) adds fused loss,
tiled MLP, activation offload and optimizer offload one at a time; each row is the longest
sequence (a multiple of 1,024) some DP x U x R x ZeRO x checkpointing plan fits, with every memory
term of that plan (``hybridsp.planner.memory``). Planner defaults: bf16, micro-batch 1, 50% of
peak FLOP/s, 4 GiB reserved per GPU, 2 TiB host memory per node, PCIe 64 GB/s per GPU, the
library's fused-loss chunk (ceil(T h / V) rows), MLP tile = h tokens, the newest layer input kept
on the device and two copies in flight, NCCL (no collective temporaries). Modelled, not measured. Writes results_ablation_planner.{json,md}.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hybridsp.planner import MODELS, ablation, format_ablation, preset_cluster  # noqa: E402

CLUSTERS = (1, 4, 8)  # nodes of 8 H100
ARCTIC = {  # Arctic long-sequence training (ALST), Llama-3.1-8B on H100, published
    1: "3.7M (ablation on 8 GPUs: 1.1M Ulysses + Liger loss, 1.2M + tiled MLP, 2.4M + activation offload, "
       "3.8M with both)",
    4: "15M", 8: "-",
}


def main() -> int:
    model = MODELS["llama3-8b"]
    sections, data = [], []
    for nodes in CLUSTERS:
        cluster = preset_cluster("h100", nodes, 8)
        rows = ablation(model, cluster)
        data.append({"nodes": nodes, "gpus": cluster.world_size, "rows": [row.to_dict() for row in rows]})
        sections += [f"## {cluster.world_size} H100 ({nodes} node{'s' if nodes > 1 else ''}); Arctic/ALST measured: "
                     f"{ARCTIC[nodes]}", "", format_ablation(rows, model, cluster), ""]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    header = ["# The planner's ablation: Llama-3-8B on H100 (modelled)", "",
              f"- Date: {date}; command: `python benchmarks/predict_ablation.py`",
              "- " + " ".join(line.strip() for line in __doc__.splitlines()[4:12]), ""]
    out = Path(__file__).resolve().parent
    (out / "results_ablation_planner.json").write_text(json.dumps({"date": date, "clusters": data}, indent=1))
    (out / "results_ablation_planner.md").write_text("\n".join(header + sections))
    print("\n".join(header + sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
