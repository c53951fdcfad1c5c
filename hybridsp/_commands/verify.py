"""Check that hybrid sequence parallelism is exact on your model before a long job: one sharded
forward and backward against float64 attention math, a table per layer, exit status 0 (pass) or 1.

    python -m hybridsp verify --model path/to/saved_model --ulysses 2 --ring 2 --seq-len 4096
    python -m hybridsp verify --config qwen3_moe --layers 2 --set hidden_size=256 --ring 3 --dtype bf16

``--model`` loads a saved transformers model (weights included); ``--config`` builds one with random
weights from a config: a ``config.json`` (or its folder) or a transformers model type, whose defaults
are the family's reference model; ``--layers N`` and ``--set field=value`` shrink it. Under a launcher
(torchrun, deepspeed) every rank runs the check; without one it starts U x R local gloo ranks on the CPU
itself. The batch is random tokens (``--seed``) of ``--seq-len``, ``--batch`` rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HELP = "check that sharded attention, gradients and loss match float64 math on your model (exit 0/1)"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a saved transformers model folder (config and weights)")
    source.add_argument("--config", help="a config.json, its folder, or a transformers model type (random weights)")
    parser.add_argument("--layers", type=int, help="keep only the first N layers (shrinks the model)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    parser.add_argument("--ulysses", type=int, default=1, help="Ulysses degree (default 1)")
    parser.add_argument("--ring", type=int, default=2, help="ring degree (default 2)")
    parser.add_argument("--layout", default="zigzag", help="token layout: zigzag, contiguous, balanced")
    parser.add_argument("--kv-comm", default="ring", help="K/V transport: ring, allgather")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="model dtype (default fp32)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per row (default 512)")
    parser.add_argument("--batch", type=int, default=1, help="rows (default 1)")
    parser.add_argument("--backend", default="auto", help="attention kernel: auto, torch, flash, reference")
    parser.add_argument("--rtol", type=float, help="one fixed relative tolerance instead of the dtype rule")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random batch and weights")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before local ranks are stopped")


def run(args: argparse.Namespace) -> int:
    overrides, problem = _overrides(args.set)
    if problem:
        print(f"verify: error: {problem}", file=sys.stderr)
        return 2
    settings = {**vars(args), "set": overrides}
    if "WORLD_SIZE" in os.environ:  # under a launcher: this process is one rank
        return _run_under_launcher(settings)
    from hybridsp.testing import run_distributed

    world = args.ulysses * args.ring
    print(f"verify: no launcher found; starting {world} local CPU ranks (gloo)", flush=True)
    try:
        results = run_distributed(_rank_main, world, settings, timeout=args.timeout)
    except AssertionError as error:  # a rank raised: its traceback's last line is the reason
        print(f"verify: error: {str(error).strip().splitlines()[-1]}", file=sys.stderr)
        return 2
    print(results[0][1])
    return 0 if results[0][0] else 1


def _overrides(pairs: list[str]) -> tuple[dict, str | None]:
    """``["a=1", "b=x"]`` -> ``{"a": 1, "b": "x"}`` (JSON values, else strings), or an error message."""
    found = {}
    for pair in pairs:
        if "=" not in pair:
            return {}, f"--set takes FIELD=VALUE, got {pair!r}"
        key, text = pair.split("=", 1)
        try:
            found[key] = json.loads(text)
        except json.JSONDecodeError:
            found[key] = text
    return found, None


def _run_under_launcher(settings: dict) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=settings["timeout"]))
    try:
        ok, table = _rank_main(dist.get_rank(), dist.get_world_size(), settings)
        if dist.get_rank() == 0:
            print(table)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, settings: dict) -> tuple[bool, str]:
    """One rank: build the mesh, the model and the batch, run the probe; (ok, table)."""
    import torch

    from hybridsp.integrations.transformers import apply
    from hybridsp.mesh import init_mesh
    from hybridsp.monitor import verify_parity

    mesh = init_mesh(settings["ulysses"], settings["ring"], layout=settings["layout"], kv_comm=settings["kv_comm"])
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model, description = _model(settings, getattr(torch, DTYPES[settings["dtype"]]), device)
    apply(model, mesh, backend=settings["backend"])
    generator = torch.Generator().manual_seed(settings["seed"])
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (settings["batch"], settings["seq_len"]), generator=generator).to(device)
    report = verify_parity(model, mesh, {"input_ids": ids, "labels": ids}, rtol=settings["rtol"])
    layers = model.config.get_text_config().num_hidden_layers
    unprobed = layers - len(report.rows)
    note = f"\n({unprobed} of {layers} layers have no softmax attention and are not probed)" if unprobed else ""
    return report.ok, f"{description}, batch {settings['batch']} x {settings['seq_len']} tokens\n{report.table()}{note}"


def _model(settings: dict, dtype, device):
    """(model, one-line description) from ``--model`` or ``--config`` with the shrinking applied."""
    import torch
    import transformers

    fields = dict(settings["set"])
    if settings["model"]:
        config = transformers.AutoConfig.from_pretrained(settings["model"])
    elif os.path.exists(settings["config"]):
        config = transformers.AutoConfig.from_pretrained(settings["config"])
    else:
        config = transformers.AutoConfig.for_model(settings["config"])
    if settings["layers"] is not None:
        fields["num_hidden_layers"] = settings["layers"]
        kinds = getattr(config, "layer_types", None)
        if kinds:
            fields["layer_types"] = list(kinds)[: settings["layers"]]
    for key, value in fields.items():
        setattr(config, key, value)
    config.attention_dropout = 0.0
    torch.manual_seed(settings["seed"])
    if settings["model"]:
        model = transformers.AutoModelForCausalLM.from_pretrained(settings["model"], config=config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())
    name = settings["model"] or settings["config"]
    return model.to(device).eval(), f"{name} ({config.model_type}, {params / 1e6:.1f}M parameters, {settings['dtype']})"
