"""The model families the switch is tested on: one tiny config per family, and what each test checks.

``FAMILIES[name]`` holds the fields of a tiny fp32 model (2 layers, 4 query heads / 2 K/V heads unless the
family's point is another shape) that keeps the family's distinguishing feature: MoE routing, per-layer
sliding/full attention, sinks, MLA's q/k head dim 24 vs v 16, soft-capping, layers without RoPE, Granite's
multipliers. ``build_family(name)`` builds it with the reference implementation transformers allows
(eager where sdpa is refused: Gemma 2, GPT-OSS).
"""

from __future__ import annotations

import json

from tests.helpers.models.tiny import tiny_causal_lm
from tests.helpers.paths import ROOT

PAD = 0
SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
    attention_dropout=0.0,
)
WINDOWED = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
EAGER_ONLY = ("gemma2", "gpt_oss")  # transformers refuses sdpa for them
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")  # with a router load-balancing loss (DeepSeek-V3 adds none)
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=16),
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    "qwen3": dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=16),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gemma2": dict(WINDOWED, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=24),
    "gemma3_text": dict(WINDOWED, query_pre_attn_scalar=24, rope_parameters=None),
    "gpt_oss": dict(WINDOWED, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        num_key_value_heads=4,
        head_dim=None,
    ),
    "olmo2": {},
    "olmo3": dict(WINDOWED),
    "phi3": {},
    "smollm3": dict(no_rope_layers=[1, 0]),
    "granite": dict(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
    "glm4": {},
    "llama4_text": dict(
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        intermediate_size_mlp=96,
        attention_chunk_size=16,
        no_rope_layers=[1, 0],
    ),  # chunked RoPE layer, full NoPE layer
}


def family_fields(name: str, **overrides) -> dict:
    """The tiny config fields of family ``name`` (None values dropped: the family's default applies)."""
    fields = {**SHAPE, **FAMILIES[name], **overrides}
    return {key: value for key, value in fields.items() if value is not None}


def build_family(name: str, seed: int = 0, **overrides):
    """The tiny fp32 model of family ``name``, weights fixed by ``seed``."""
    implementation = "eager" if name in EAGER_ONLY else "sdpa"
    return tiny_causal_lm(name, seed=seed, attn_implementation=implementation, **family_fields(name, **overrides))


# ---- the support matrix: what the tests check per family (rendered into docs/model-support.md) ----------------

EXACT, UNTESTED = "exact", "not tested"
CHECKS = ("switch", "packed", "trainer", "TRL SFT", "tensor parallel", "generate")
REFUSED = "refused: "  # a cell "refused: <reason>": a test asserts the refusal names the reason
COLUMNS = {  # check -> what "exact" means there, and the test that asserts it
    "switch": (
        "U2xR2 logits, loss and every parameter gradient vs the unmodified model",
        "tests/integrations/transformers/families/test_switch_matrix.py",
    ),
    "packed": (
        "packed documents at U2xR2 vs the unmodified model run per document",
        "tests/integrations/transformers/families/test_switch_matrix.py",
    ),
    "trainer": (
        "HybridSPTrainer at U2xR2 vs the plain Trainer (loss, grad norm per step; MoE: with the router "
        "loss, and the router weights after training)",
        "tests/integrations/transformers/test_trainer.py, tests/integrations/transformers/test_router_loss.py, "
        "tests/integrations/transformers/families/test_trainer_matrix.py",
    ),
    "TRL SFT": (
        "HybridSFTTrainer at U2xR1 or U2xR2 vs TRL's SFTTrainer, per-step loss and grad norm (MoE: with the "
        "router loss)",
        "tests/integrations/trl/test_trainers.py, tests/integrations/transformers/test_router_loss.py",
    ),
    "tensor parallel": (
        "T2xU2 with sequence parallelism vs the unmodified model",
        "tests/tensor_parallel/test_families.py",
    ),
    "generate": (
        "greedy ids of hybridsp.integrations.transformers.generate equal model.generate at U2xR2",
        "tests/integrations/transformers/families/test_generate_matrix.py",
    ),
}


def _row(switch=EXACT, packed=EXACT, trainer=UNTESTED, trl=UNTESTED, tensor=EXACT, generate=UNTESTED) -> dict[str, str]:
    return dict(zip(CHECKS, (switch, packed, trainer, trl, tensor, generate)))


SUPPORT = {
    "llama": _row(trainer=EXACT, trl=EXACT, tensor=EXACT, generate=EXACT),
    "mistral": _row(trainer=EXACT, generate=EXACT),
    "qwen2": _row(trainer=EXACT, generate=EXACT),
    "qwen3": _row(trainer=EXACT, generate=EXACT),
    "qwen3_moe": _row(trainer=EXACT, trl=EXACT, generate=EXACT),
    "mixtral": _row(trainer=EXACT, generate=EXACT),
    "gemma2": _row(trainer=EXACT, generate=EXACT),
    "gemma3_text": _row(trainer=EXACT, generate=EXACT),
    "gpt_oss": _row(trainer=EXACT, generate=EXACT),
    "deepseek_v3": _row(trainer=EXACT, generate=EXACT),
    "olmo2": _row(trainer=EXACT, generate=EXACT),
    "olmo3": _row(trainer=EXACT, generate=EXACT),
    "phi3": _row(trainer=EXACT, generate=EXACT),
    "smollm3": _row(trainer=EXACT, generate=EXACT),
    "granite": _row(trainer=EXACT, generate=EXACT),
    "glm4": _row(trainer=EXACT, generate=EXACT),
    "llama4_text": _row(tensor=UNTESTED, generate=REFUSED + "chunked-attention layer"),
}


LINEAR_TESTS = "tests/linear/test_hf_models.py"
LINEAR_GENERATE = "tests/linear/test_generate.py"
LINEAR_SUPPORT = {  # hybrid linear-attention families: tiny configs in tests/helpers/models/linear.py, tested there
    name: dict(
        zip(CHECKS, (f"{EXACT} ({LINEAR_TESTS})", f"{EXACT} ({LINEAR_TESTS})", trainer, sft, UNTESTED, generate))
    )
    for name, trainer, sft, generate in (
        (
            "qwen3_5_text",
            f"{EXACT} ({LINEAR_TESTS}, slow)",
            f"{EXACT} (packed; tests/integrations/trl/test_trainers.py, slow)",
            f"{EXACT} ({LINEAR_GENERATE}, U2xR2, U1xR2)",
        ),
        ("qwen3_next", UNTESTED, UNTESTED, f"{EXACT} ({LINEAR_GENERATE}, U1xR3, slow)"),
        ("nemotron_h", UNTESTED, UNTESTED, f"{EXACT} ({LINEAR_GENERATE}, U2xR2, U1xR2)"),
    )
}


def families_where(check: str, value: str = EXACT) -> list[str]:
    """The families whose ``check`` cell is ``value`` (``REFUSED``: any refusal)."""
    return [
        name
        for name, row in SUPPORT.items()
        if row[check] == value or (value == REFUSED and row[check].startswith(REFUSED))
    ]


MIXER_HOWTO = """A recurrence, a convolution over the sequence, a state-space scan or a sparse indexer would restart at
every shard boundary if it ran per shard, so the switch replaces such a module only when a `MixerAdapter`
claims it by its class (Gated DeltaNet of Qwen3.5, Qwen3.5-MoE and Qwen3-Next; Mamba-2 of Nemotron-H), and
refuses the model otherwise. To switch a model with another mixer, implement the protocol and pass it; test
it against the family's unmodified model at U2xR2 or U1xR2 as `tests/linear/test_hf_models.py` does:

```python
from hybridsp.integrations.transformers import MixerAdapter, apply, check_switchable, default_mixers


class MyConvAdapter(MixerAdapter):
    name = "my short convolution"

    def matches(self, module):  # by identity, never by attribute names
        return type(module).__name__ == "MyShortConv" and type(module).__module__ == "my_model.modeling"

    def check(self, module, mesh):  # ValueError for what this mesh cannot run
        ...

    def switch(self, module, mesh):  # replace the instance's forward with a sharded one; return the undo
        ...


mixers = (*default_mixers(), MyConvAdapter())
check_switchable(model, mesh, mixers=mixers)  # the same decision as apply
handle = apply(model, mesh, mixers=mixers)
```
"""

AUDIT_HEADER = """## Every decoder family of the installed transformers: the audit

`python -m tests.helpers.audit` builds every model type of transformers' causal-LM auto mapping on the meta
device from its default config and asks the switch's decision (`check_switchable`, the same
decision `apply` takes); every model the switch takes is then built tiny and random (4 layers, hidden 64,
4 query / 2 K/V heads where the config has those fields) and compared at U1xR2 on 2 gloo ranks with the
unmodified model on one process: logits and every parameter gradient, largest relative error (fp32,
tolerance 1e-4; a gradient is compared relative to its own largest value or to 1e-3 of the model's largest
gradient, whichever is larger, since some are zero in exact arithmetic, e.g. a key bias under softmax; dropout
and router jitter off, as they are random). `exact`: switched and within tolerance; `refused`: the switch's one-line refusal
(shortened here); `defect`: switched but not exact, or failing at the first forward (none at this version); `not built`:
transformers itself cannot build the family's default or tiny config here (its error is shown: either
the default config or the tiny copy fails in transformers, or the unmodified model's own forward does). Ask the switch about your own saved model, on the meta device:
`python -m hybridsp check-model PATH --ulysses U --ring R` (exit 1 with the refusal line).
"""


def render_audit(audit: dict) -> list[str]:
    """The audit table (``docs/model-support-audit.json``, written by ``python -m tests.helpers.audit``)."""
    rows = audit["families"]
    counts = {kind: sum(row["decision"] == kind for row in rows.values()) for kind in AUDIT_KINDS}
    lines = [AUDIT_HEADER, f"transformers {audit['transformers']}: " + ", ".join(f"{n} {k}" for k, n in counts.items())]
    lines += ["", "| model type | model | decision | largest relative error, or the reason |", "|---|---|---|---|"]
    for name, row in sorted(rows.items()):
        detail = f"{row['max_rel']:.1e} (U1xR2)" if "max_rel" in row and row["decision"] == "exact" else ""
        detail = (
            detail
            or _short(row.get("detail", ""))
            or (f"{row['max_rel']:.1e} ({row.get('worst')})" if "max_rel" in row else "")
        )
        lines.append(f"| {name} | {row.get('model', '')} | {row['decision']} | {detail} |")
    return lines


AUDIT_KINDS = ("exact", "refused", "defect", "not built")


def _short(text: str, limit: int = 220) -> str:
    text = text.replace("|", "/").replace("ValueError: ", "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render_support_matrix() -> str:
    """docs/model-support.md, from :data:`SUPPORT` (``python -m tests.helpers.families > docs/model-support.md``)."""
    lines = [
        "# Model support: what the tests check per family",
        "",
        "Generated from `tests/helpers/families.py` (`python -m tests.helpers.families > docs/model-support.md`);",
        "`tests/integrations/transformers/families/test_support_doc.py` keeps this page equal to the table the",
        "tests run. Every family is a tiny config built locally (2 layers, its distinguishing feature kept) and is",
        "compared against the unmodified transformers model on one process. The switch takes any causal decoder",
        "whose attention calls transformers' attention interface (docs/hf-trainer.md) and refuses, in one line and",
        "before any change or collective, every other module that mixes tokens across positions unless a mixer",
        "adapter claims it by class (below); the audit at the end of this page runs that decision on every family.",
        "",
        MIXER_HOWTO,
        "",
        "| check | exact means | test |",
        "|---|---|---|",
    ]
    lines += [f"| {check} | {meaning} | `{test}` |" for check, (meaning, test) in COLUMNS.items()]
    lines += ["", "| family | " + " | ".join(CHECKS) + " |", "|---|" + "---|" * len(CHECKS)]
    lines += [f"| {name} | " + " | ".join(row[c] for c in CHECKS) + " |" for name, row in SUPPORT.items()]
    lines += [
        "",
        "Hybrid linear-attention families (Gated DeltaNet, Mamba-2 layers with exact state passing; "
        "[linear-attention.md](linear-attention.md)):",
        "",
        "| family | " + " | ".join(CHECKS) + " |",
        "|---|" + "---|" * len(CHECKS),
    ]
    lines += [f"| {name} | " + " | ".join(row[c] for c in CHECKS) + " |" for name, row in LINEAR_SUPPORT.items()]
    audit = ROOT / "docs" / "model-support-audit.json"
    if audit.exists():
        lines += ["", *render_audit(json.loads(audit.read_text()))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_support_matrix(), end="")
