"""The example run the longest-context benchmarks measure: its configs, model and the planner's view.

Shared by :mod:`bench_longest_context` (which measures), :mod:`longest_report` (which renders) and
:mod:`bench_ablation` / :mod:`bench_memory`; importing it puts ``examples/`` and the repository
root on ``sys.path`` (the example's ``train`` module and ``hybridsp``).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


CONFIGS = {  # name -> (world, ulysses, ring, ds config)
    "w1": (1, 1, 1, "cp1.json"),
    "cp2": (2, 2, 1, "cp2.json"),
    "cp4": (4, 2, 2, "cp4.json"),
    "cp8": (8, 4, 2, "cp8.json"),
}
VOCAB = 256  # examples/text_data.py BYTE_VOCAB


def example_model_spec():
    """The example model of examples/train.py (defaults, byte vocabulary) as a planner ModelSpec."""
    import train

    from hybridsp.planner import ModelSpec

    args = train.parse_args([])
    intermediate = int(args.hidden_size * 8 / 3) // 64 * 64  # as train.build_model computes it
    return ModelSpec(num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden_size // args.heads,
                     hidden_size=args.hidden_size, intermediate_size=intermediate, num_layers=args.layers,
                     vocab_size=VOCAB, tied_embeddings=True, name="examples/train.py default")


def planner_memory(ulysses: int, ring: int, world: int, seq_len: int) -> dict:
    """The planner's per-rank memory for one fp32 (dtype_bytes=4) ZeRO-3 step, no checkpointing."""
    from hybridsp.planner import MeshConfig, Workload, memory_use

    use = memory_use(example_model_spec(), Workload(seq_len, dtype_bytes=4),
                     MeshConfig(world // (ulysses * ring), ulysses, ring, zero_stage=3, checkpointing=False))
    row = asdict(use)
    row.update(model_states=use.model_states, step=use.step, total=use.total)
    return row
