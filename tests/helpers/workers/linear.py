"""Workers of the linear-layer tests: a switched hybrid model on a U x R mesh against the unmodified
model on one process (per document), forward and every parameter gradient."""

from __future__ import annotations

import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from tests.helpers.models.linear import packed_batch, per_document_reference, tiny_hybrid
from tests.helpers.models.switched import sharded
from tests.helpers.references.attention import rel_err


def model_errors(
    family: str, ulysses: int, ring: int, rows, layout: str = "zigzag", linear: bool = True, checkpointing: bool = False
) -> dict:
    """{what: relative error} of logits, loss and every parameter gradient (summed over the context
    group) of ``family`` switched onto a ``ulysses x ring`` mesh, against the per-document reference.
    ``linear=False``: the linear layers are switched back right away (the unmodified mixers run per shard);
    ``checkpointing``: the switched model recomputes every layer in backward (gradient checkpointing)."""
    model = tiny_hybrid(family)
    batch = packed_batch(rows)
    ref_logits, ref_loss, ref_grads = per_document_reference(model, batch, rows)
    mesh = init_mesh(ulysses=ulysses, ring=ring, layout=layout)
    with hf.apply(model, mesh) as handle:
        if not linear:
            handle.undo_linear()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        logits, loss, grads, _ = sharded(model, mesh, batch)
    errors = {"logits": rel_err(logits, ref_logits), "loss": rel_err(loss, ref_loss)}
    errors.update({f"grad {n}": rel_err(g, ref_grads[n]) if n in ref_grads else float("inf") for n, g in grads.items()})
    return errors


def cases_worker(rank: int, world: int, cases) -> dict:
    """Each case ``(name, family, ulysses, ring, rows, layout, linear[, checkpointing])`` -> its worst error and
    what it was."""
    found = {}
    for name, family, ulysses, ring, rows, layout, linear, *checkpointing in cases:
        errors = model_errors(family, ulysses, ring, rows, layout, linear, *checkpointing)
        worst = max(errors, key=errors.get)
        found[name] = (errors[worst], worst)
    return found


def train_hybrid_model(rank: int, world: int, family: str, hybrid: dict | None) -> dict | None:
    """Train ``family``'s tiny hybrid model 4 steps on 16 documents: the plain Trainer one document per row
    (``hybrid`` None, one process), or HybridSPTrainer on rows of two packed documents over ``hybrid``'s
    ``ulysses`` x ``ring`` with ZeRO ``stage``; rank 0 returns the per-step loss and grad_norm."""
    import tempfile

    from transformers import Trainer

    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build
    from hybridsp.integrations.transformers import HybridSPTrainer
    from tests.helpers.workers.trainer import VOCAB as TRAINER_VOCAB
    from tests.helpers.workers.trainer import _arguments, collate, ds_config, samples, step_logs

    docs = samples(16, seed=1)
    model = tiny_hybrid(family, vocab_size=TRAINER_VOCAB, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        if hybrid is None:
            args = _arguments(out, None, per_device_train_batch_size=2, train_sampling_strategy="sequential")
            trainer = Trainer(model=model, args=args, train_dataset=docs, data_collator=collate)
        else:
            config = ds_config(hybrid["ulysses"], hybrid["ring"], hybrid["stage"], False)
            args = _arguments(out, config, per_device_train_batch_size=1, train_sampling_strategy="sequential")
            trainer = HybridSPTrainer(
                model=model, args=args, train_dataset=packed_pairs(docs), data_collator=packed_collate
            )
        trainer.train()
    return step_logs(trainer) if rank == 0 else None


def packed_pairs(docs: list[dict]) -> list[dict]:
    """Every two consecutive documents as one row; position_ids restart at each document."""
    return [
        {key: torch.cat([d[key] for d in docs[i : i + 2]]) for key in ("input_ids", "labels")}
        | {"position_ids": torch.cat([torch.arange(len(d["input_ids"])) for d in docs[i : i + 2]])}
        for i in range(0, len(docs), 2)
    ]


def packed_collate(rows: list[dict]) -> dict:
    """Right padding (ids 0, labels -100, mask 0), positions continuing after the last document."""
    from tests.helpers.workers.trainer import collate

    batch = collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    longest = batch["input_ids"].shape[1]
    positions = [
        torch.cat([r["position_ids"], torch.arange(1, longest - len(r["position_ids"]) + 1) + r["position_ids"][-1]])
        for r in rows
    ]
    return {**batch, "position_ids": torch.stack(positions)}  # each [B, S]


def bf16_errors(rank: int, world: int, family: str, ulysses: int, ring: int, rows) -> dict:
    """Max |logits - fp32 reference| of the bf16 model on one process (per document) and switched onto the
    mesh, both against the fp32 model per document (flash-attn's rule: the sharded error <= ~2x the other)."""
    model = tiny_hybrid(family)
    batch = packed_batch(rows)
    reference = per_document_reference(model, batch, rows)[0]
    model = model.to(torch.bfloat16)
    single = per_document_reference(model, batch, rows)[0]
    mesh = init_mesh(ulysses=ulysses, ring=ring)
    with hf.apply(model, mesh):
        logits = sharded(model, mesh, batch)[0].float()
    return {"single": float((single - reference).abs().max()), "sharded": float((logits - reference).abs().max())}


def generation_errors(rank: int, world: int, cases) -> dict:
    """Each case ``(name, family, ulysses, ring, prompt_length, new_tokens[, layout])``: hybridsp's greedy ``generate`` of
    ``family``'s tiny model (B = 2 different rows) against the unmodified model's own ``model.generate`` ->
    (ids equal, worst relative error of the logits that chose each token)."""
    from tests.helpers.models.generation import reference_generate

    found = {}
    for name, family, ulysses, ring, length, new, *layout in cases:
        model = tiny_hybrid(family).eval()
        model.generation_config.eos_token_id = None  # never stop early: every step is compared
        ids = packed_batch(((length,), (length,)), seed=length)["input_ids"]  # [2, S]
        ref_ids, ref_logits = reference_generate(model, ids, max_new_tokens=new)
        mesh = init_mesh(ulysses=ulysses, ring=ring, layout=(layout or ["zigzag"])[0])
        with hf.apply(model, mesh):
            ours, logits = hf.generate(model, ids, mesh=mesh, max_new_tokens=new, eos_token_id=[], output_logits=True)
        found[name] = (bool(torch.equal(ours, ref_ids)), rel_err(logits, ref_logits))
    return found
