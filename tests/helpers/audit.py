"""The audit of every decoder family in the installed transformers (issue 47).

For each model type of transformers' causal-LM auto mapping: build it on the meta device from its default
config (its real layer pattern, no weights) and ask the switch's decision
(:func:`hybridsp.integrations.transformers.check_switchable`, which is what ``apply`` decides); for every model
the switch takes, build a tiny random copy (4 layers, hidden 64, 4 query / 2 K/V heads where the config has
those fields; dropout off in both, since attention dropout is refused by design) and compare, at U1xR2 on 2 gloo ranks, the switched model's logits, loss and every parameter
gradient with the unmodified model's on one process. Each family ends as one of:

- ``exact``: switched, largest relative error under :data:`TOLERANCE` (reported);
- ``refused``: ``check_switchable`` / ``apply`` raise ValueError (the first sentence is reported);
- ``defect``: switched but not exact, or failing at the first forward (the error is reported);
- ``not built``: transformers cannot build the family from its default config here (the error is reported).

``python -m tests.helpers.audit [--only a,b] [--out FILE]`` writes the results as JSON (default
``docs/model-support-audit.json``); ``python -m tests.helpers.families > docs/model-support.md`` renders
them with the per-family test matrix.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path

import torch

TOLERANCE = 1e-4  # fp32: relative to the largest value of each tensor
FLOOR = 1e-3  # ... or to this fraction of the largest gradient of the model, when that is larger
AUDIT_FILE = Path(__file__).resolve().parents[2] / "docs" / "model-support-audit.json"
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=256,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
NO_DROPOUT = dict.fromkeys(
    (
        "attention_dropout",
        "attn_pdrop",
        "resid_pdrop",
        "embd_pdrop",
        "hidden_dropout",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "dropout",
        "activation_dropout",
        "router_jitter_noise",
        "input_jitter_noise",
    ),
    0.0,
)  # attention dropout is refused by design; the audit asks about what the model computes
SEQ, BATCH, CHUNK = 32, 2, 12
MAX_PARAMETERS = 20_000_000  # 80 MB in fp32 per copy: the tiny fields did their job


def quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def decision(model_type: str) -> dict:
    """The switch's answer for the family's default config, built on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridsp.integrations.transformers import check_switchable

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **_fields_of(model_type, {})))
    except Exception as error:  # noqa: BLE001 - any failure to build is reported, not raised
        return dict(decision="not built", detail=_first_line(error))
    try:
        check_switchable(model)
    except ValueError as error:
        return dict(decision="refused", detail=_first_line(error), model=type(model).__name__)
    return dict(decision="switched", model=type(model).__name__)


def tiny_model(model_type: str, seed: int = 0):
    """The family's tiny fp32 model (sdpa where the family has it, else eager), weights fixed by ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **_fields_of(model_type))
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:  # a field the tiny fields did not reach (a nested text config's vocabulary)
        raise ValueError(f"the tiny copy still has {size:,} parameters (over {MAX_PARAMETERS:,})")
    torch.manual_seed(seed)
    for implementation in ("sdpa", "eager"):
        try:
            return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).float()
        except (ValueError, ImportError):
            continue
    raise ValueError(f"{model_type}: neither sdpa nor eager attention builds")


def _fields_of(model_type: str, tiny: dict = TINY) -> dict:
    """``tiny`` and :data:`NO_DROPOUT` restricted to the fields the family's config has."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    fields = {key: value for key, value in {**tiny, **NO_DROPOUT}.items() if hasattr(default, key)}
    fields |= {key: 0.0 for key, value in vars(default).items() if _is_noise(key, value)}
    text = getattr(default, "text_config", None)
    if text is not None and not isinstance(text, dict):  # a multimodal model: shrink its language model too
        fields["text_config"] = {key: value for key, value in {**tiny, **NO_DROPOUT}.items() if hasattr(text, key)}
        fields["text_config"] |= {key: 0.0 for key, value in vars(text).items() if _is_noise(key, value)}
    if "qk_rope_head_dim" in fields:  # MLA: the head dim is the rope part's, every head has its own K/V
        fields.pop("head_dim", None)
        fields["num_key_value_heads"] = fields.get("num_attention_heads", 4)
    return fields


def _is_noise(key: str, value) -> bool:
    """A random perturbation of training (dropout, router jitter): off in the audit, since it is random."""
    return isinstance(value, float) and any(word in key for word in ("dropout", "pdrop", "jitter"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


def compare_family(rank: int, world: int, model_type: str) -> dict:
    """On each of 2 ranks: the unmodified model on the whole batch vs the switched one at U1xR2."""
    import torch.distributed as dist

    from hybridsp import gather_sequence, init_mesh, shard_batch, sharded_cross_entropy
    from hybridsp.integrations import transformers as hf

    quiet()
    try:
        model = tiny_model(model_type)
    except Exception as error:  # noqa: BLE001
        return dict(decision="not built", detail=_first_line(error))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, min(128, model.config.get_text_config().vocab_size), (BATCH, SEQ), generator=gen)
    try:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
    except Exception as error:  # noqa: BLE001 - the unmodified model itself fails: not ours to judge
        return dict(decision="not built", detail="the unmodified model fails: " + _first_line(error))
    expected = (out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    mesh = init_mesh(1, world)
    try:
        with hf.apply(model, mesh):
            local = shard_batch({"input_ids": ids, "labels": ids}, mesh, sliding_window=hf.layout_window(model))
            logits = model(
                input_ids=local["input_ids"],
                position_ids=local["position_ids"],
                hybridsp_documents=local["documents"],
                use_cache=False,
            ).logits
            sharded_cross_entropy(logits, local["shift_labels"], mesh).backward()
            logits = gather_sequence(logits.detach(), mesh, cu_seqlens=local["documents"])
    except ValueError as error:
        return dict(decision="refused", detail=_first_line(error))
    except Exception as error:  # noqa: BLE001 - a switched model that fails is a defect
        return dict(decision="defect", detail=_first_line(error))
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None and name in expected[1]:
            grads[name] = param.grad.clone()
            dist.all_reduce(grads[name], group=mesh.context_group)
    errors = {"logits": _rel(logits, expected[0], 0.0)}
    floor = FLOOR * max(g.abs().max().item() for g in expected[1].values())
    errors.update({name: _rel(grad, expected[1][name], floor) for name, grad in grads.items()})
    worst = max(errors, key=lambda k: errors[k])
    exact = errors[worst] <= TOLERANCE
    return dict(decision="exact" if exact else "defect", max_rel=errors[worst], worst=worst, mesh="U1xR2")


def _rel(found: torch.Tensor, expected: torch.Tensor, floor: float) -> float:
    """Largest error relative to the tensor's largest value, or to ``floor`` when that is smaller: a gradient
    that is zero in exact arithmetic (a key bias under softmax) is compared with the model's gradient scale."""
    scale = max(expected.abs().max().item(), floor) or 1.0
    return float((found - expected).abs().max().item() / scale)


def _compare_many(rank: int, world: int, types: list[str]) -> dict:
    return {name: compare_family(rank, world, name) for name in types}


def audit(types: list[str], out: Path, chunk: int = CHUNK) -> dict[str, dict]:
    """The audit's row per family (module docstring), written to ``out`` after each step; families ``out``
    already holds with a final answer are kept (rerun after an interruption)."""
    from hybridsp.testing import run_distributed

    quiet()
    done = json.loads(out.read_text())["families"] if out.exists() else {}
    rows = {name: done.get(name) or decision(name) for name in types}
    _write(out, {**done, **rows})
    switched = [name for name, row in rows.items() if row["decision"] == "switched"]
    for start in range(0, len(switched), chunk):
        part = switched[start : start + chunk]
        try:
            results = run_distributed(_compare_many, 2, part, timeout=900.0)[0]
        except Exception:  # noqa: BLE001 - one family hung or crashed a rank: run them one by one
            results = {name: _compare_alone(name) for name in part}
        for name in part:
            rows[name] = {**rows[name], **results[name]}
        _write(out, {**done, **rows})
    return rows


def _write(out: Path, rows: dict) -> None:
    import transformers

    out.write_text(json.dumps(dict(transformers=transformers.__version__, families=rows), indent=1) + "\n")


def _compare_alone(name: str) -> dict:
    from hybridsp.testing import run_distributed

    try:
        return run_distributed(compare_family, 2, name, timeout=300.0)[0]
    except Exception as error:  # noqa: BLE001
        return dict(decision="defect", detail="the ranks failed: " + _first_line(error))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: all causal-LM types)")
    parser.add_argument("--out", type=Path, default=AUDIT_FILE)
    args = parser.parse_args()
    types = args.only.split(",") if args.only else model_types()
    rows = audit(types, args.out)
    for name, row in rows.items():
        print(f"{name:28s} {row['decision']:10s} {row.get('max_rel', '')!s:24s} {row.get('detail', '')[:110]}")


if __name__ == "__main__":
    main()
