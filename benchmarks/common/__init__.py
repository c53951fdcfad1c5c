"""What more than one benchmark uses (benchmarks import nothing from ``tests``).

- :mod:`.harness`: launch, interleaved timing, verification, memory, bytes, machine info, results paths;
- :mod:`.trees`: workers under another checkout's hybridsp (before / after comparisons);
- :mod:`.overhead`: the per-call overhead of hybrid_attn_func on a 1 x 1 mesh;
- :mod:`.peers`: the peers' methods and CPU kernel (attention.peers, memory.a2a);
- :mod:`.example`: the example run of ``examples/train.py`` (configs, model, the planner's view) and the
  examples' modules loaded by path;
- :mod:`.longest`: one training step under a per-rank memory cap and the longest-context search
  (longest.context, longest.ablation, memory.loss);
- :mod:`.packs`: packed documents (packed.balance, packed.balance_windows, e2e.compile);
- :mod:`.alst_stacks`: the stacks of the end-to-end comparison against DeepSpeed's ALST (alst.compare and
  ``tests/benchmarks/test_alst_parity.py``);
- :mod:`.trainer`: the tiny HF Trainer jobs of e2e.trainer_grad_scale.
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # benchmarks/
ROOT = PACKAGE.parent  # the repository
