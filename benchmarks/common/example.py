"""The example run the longest-context benchmarks measure: its configs, model and the planner's view.

Shared by longest.context (which measures), longest._report (which renders), longest.ablation and
memory.loss. The examples are scripts, not a package: :func:`example` loads ``examples/<name>.py`` by
its path as the module ``name`` (what ``import name`` gives when ``examples/`` is on the path), so that
nothing here edits ``sys.path``.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict
from types import ModuleType

from benchmarks.common import ROOT

EXAMPLES = ROOT / "examples"


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``name`` (loaded once; ``train`` loads its own siblings)."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


CONFIGS = {  # name -> (world, ulysses, ring, ds config)
    "w1": (1, 1, 1, "cp1.json"),
    "cp2": (2, 2, 1, "cp2.json"),
    "cp4": (4, 2, 2, "cp4.json"),
    "cp8": (8, 4, 2, "cp8.json"),
}
VOCAB = 256  # examples/text_data.py BYTE_VOCAB


def example_model_spec():
    """The example model of examples/train.py (defaults, byte vocabulary) as a planner ModelSpec."""
    from hybridsp.planner import ModelSpec

    train = example("train")
    args = train.parse_args([])
    intermediate = int(args.hidden_size * 8 / 3) // 64 * 64  # as train.build_model computes it
    return ModelSpec(
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        hidden_size=args.hidden_size,
        intermediate_size=intermediate,
        num_layers=args.layers,
        vocab_size=VOCAB,
        tied_embeddings=True,
        name="examples/train.py default",
    )


def planner_memory(ulysses: int, ring: int, world: int, seq_len: int) -> dict:
    """The planner's per-rank memory for one fp32 (dtype_bytes=4) ZeRO-3 step, no checkpointing."""
    from hybridsp.planner import MeshConfig, Workload, memory_use

    use = memory_use(
        example_model_spec(),
        Workload(seq_len, dtype_bytes=4),
        MeshConfig(world // (ulysses * ring), ulysses, ring, zero_stage=3, checkpointing=False),
    )
    row = asdict(use)
    row.update(model_states=use.model_states, step=use.step, total=use.total)
    return row
