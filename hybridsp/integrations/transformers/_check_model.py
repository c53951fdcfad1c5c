"""Ask the switch about a saved model before a long job: what it would switch, or why it refuses.

    python -m hybridsp check-model PATH_OR_MODEL_TYPE [--ulysses U] [--ring R]

PATH is a directory with a transformers ``config.json`` (a checkpoint, or a config alone), or a model type
of the installed transformers (``llama``, ``qwen3_5_text``, ...). The model is built on the meta device (no
weights read, no memory used) and the switch's own decision runs on it
(:func:`~hybridsp.integrations.transformers._decision.decide`, the one ``apply`` and ``check_switchable``
take): the attention layers it would switch, the token mixers an adapter claims (by class), and either
"switchable" or the one-line refusal naming the module, its layers and what to do. Exit status 0 when the
model is switchable on the given degrees, 1 when it is refused. Whether the switched model is exact on the
user's own weights and data is the exactness probe's question (docs/model-support.md says where to run it);
the families of the installed transformers were audited (docs/model-support.md).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any, cast

HELP = "ask the attention switch about a saved model (built on the meta device): switched or refused, and why"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a directory holding config.json, or a transformers model type")
    parser.add_argument("--ulysses", type=int, default=1, help="Ulysses degree of the planned job (default 1)")
    parser.add_argument("--ring", type=int, default=1, help="ring degree of the planned job (default 1)")


def build_on_meta(model: str):
    """The causal LM of ``model`` (a config directory or a model type) on the meta device."""
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model) if os.path.isdir(model) else AutoConfig.for_model(model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def run(args: argparse.Namespace) -> int:
    from hybridsp.integrations.transformers._decision import decide
    from hybridsp.mesh._hybrid_mesh import HybridMesh, MeshShape

    if args.ulysses < 1 or args.ring < 1:
        raise SystemExit(f"--ulysses and --ring must be >= 1, got {args.ulysses} and {args.ring}")
    model = build_on_meta(args.model)
    shape = MeshShape(args.ulysses * args.ring, args.ulysses, args.ring)
    no_groups = cast("dict[str, Any]", dict.fromkeys(["ulysses", "ring", "context", "data", "data_context"]))
    mesh = HybridMesh(shape, 0, no_groups)  # the decision reads degrees only; no process group is made
    name = f"{type(model).__name__} at U{args.ulysses}xR{args.ring}"
    try:
        decision = decide(model, mesh)
    except ValueError as error:
        print(f"{name}: refused. {error}")
        return 1
    if decision.adapter is not None:
        print(f"{name}: switchable by the model adapter {decision.adapter.name!r}")
        return 0
    attention = Counter(type(m).__name__ for m in decision.attention)
    print(f"{name}: switchable")
    for klass, count in attention.items():
        print(f"  attention  {klass}: {count} layers (the attention interface call, replaced)")
    mixers = Counter((type(m).__name__, adapter.name) for m, adapter in decision.mixers)
    for (klass, adapter), count in mixers.items():
        print(f"  mixer      {klass}: {count} layers (switched by the adapter {adapter!r})")
    return 0
