"""Distributed workers for tests/integrations/transformers/test_router_loss.py and the family Trainer matrix: tiny
models (tests/helpers/families.py; the MoE families with the router load-balancing loss on), trained by the plain Trainer /
TRL's SFTTrainer on one process or by HybridSPTrainer / HybridSFTTrainer on gloo ranks, and one
``causal_lm_loss`` call against the unmodified model.

Rank 0 returns what the tests compare: per-step ``loss`` and ``grad_norm``, the evaluation loss, TRL's
logged ``aux_loss``, and every parameter's change over the training (the router weights' is the real
check: the router loss moves the logged loss by little).
"""

from __future__ import annotations

import os
import tempfile

import torch

from tests.helpers.workers.trainer import collate, ds_config, samples

ROUTER_COEF = 0.05  # Mixtral's default is 0.02, Qwen3-MoE's 0.001: larger, so that a wrong loss shows
STEPS, ACCUMULATION, MICRO_BATCH = 3, 2, 2


def moe_model(family: str):
    """The family's tiny fp32 model; an MoE family's with ``output_router_logits`` on and :data:`ROUTER_COEF`."""
    from tests.helpers.families import MOE_FAMILIES, build_family

    if family not in MOE_FAMILIES:
        return build_family(family)
    return build_family(family, output_router_logits=True, router_aux_loss_coef=ROUTER_COEF)


def _settings(output_dir: str, hybrid: dict | None) -> dict:
    deepspeed = None if hybrid is None else ds_config(hybrid["ulysses"], hybrid["ring"], hybrid["stage"], False)
    return dict(  # SGD: the trained weights move linearly with the gradients (Adam would amplify rounding)
        output_dir=output_dir,
        per_device_train_batch_size=MICRO_BATCH,
        per_device_eval_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        max_grad_norm=1.0,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        deepspeed=deepspeed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
    )


def _trainer(case: dict, output_dir: str):
    """The plain trainer (``case["hybrid"]`` None) or ours, for ``case["item"]`` "trainer" or "sft"."""
    hybrid, model = case["hybrid"], moe_model(case["family"])
    if case["item"] == "sft":
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from hybridsp.integrations.trl import HybridSFTTrainer
        from tests.helpers.workers.trl_sft import sft_rows, tokenizer

        args = SFTConfig(**_settings(output_dir, hybrid), bf16=False, max_length=48, dataset_num_proc=None)
        cls = SFTTrainer if hybrid is None else HybridSFTTrainer
        data, held_out = (Dataset.from_list(sft_rows(n, seed=seed, packing=False)) for n, seed in ((16, 1), (4, 3)))
        return cls(model=model, args=args, train_dataset=data, eval_dataset=held_out, processing_class=tokenizer())
    from transformers import Trainer, TrainingArguments

    from hybridsp.integrations.transformers import HybridSPTrainer

    args = TrainingArguments(**_settings(output_dir, hybrid), remove_unused_columns=False)
    cls = Trainer if hybrid is None else HybridSPTrainer
    return cls(
        model=model,
        args=args,
        train_dataset=samples(16, seed=1),
        eval_dataset=samples(5, seed=2),
        data_collator=collate,
    )


def train(rank: int, case: dict) -> dict | None:
    """Train :data:`STEPS` steps and evaluate; rank 0 returns the logs and the trained parameters."""
    from hybridsp.integrations.deepspeed import without_cpu_shm_comm_build

    with tempfile.TemporaryDirectory() as out, without_cpu_shm_comm_build():
        trainer = _trainer(case, out)
        trainer.train()
        metrics = trainer.evaluate()
    if rank != 0:
        return None
    logged = [row for row in trainer.state.log_history if "loss" in row and "grad_norm" in row]
    initial = dict(moe_model(case["family"]).named_parameters())
    return {
        **{key: [row.get(key) for row in logged] for key in ("step", "loss", "grad_norm", "aux_loss")},
        "updates": {
            name: (p.detach() - initial[name].detach()).tolist()  # lists: no shared memory
            for name, p in trainer.model.named_parameters()
        },
        "eval_loss": metrics["eval_loss"],
    }


def causal_lm_loss_check(rank: int, case: dict) -> dict | None:
    """``causal_lm_loss`` of a switched model at ``case["ulysses"] x case["ring"]`` against the unmodified
    model's ``model(**batch).loss`` (cross-entropy + coefficient x load-balancing loss) on the full batch;
    rank 0 returns both values and the relative error of every parameter gradient (summed over the ranks)."""
    import torch.distributed as dist

    from hybridsp import init_mesh, real_token_mask, shard_batch
    from hybridsp.integrations.transformers import apply, causal_lm_loss

    mesh = init_mesh(ulysses=case["ulysses"], ring=case["ring"])
    batch = collate(samples(2, seed=4))  # B = 2, right-padded rows of different lengths
    reference, ours = moe_model(case["family"]), moe_model(case["family"])
    expected = reference(**batch).loss
    expected.backward()
    apply(ours, mesh)
    local = shard_batch(batch, mesh, pad_token_id=0)
    loss = causal_lm_loss(ours, local, mesh, token_mask=real_token_mask(batch, mesh, local["documents"]))
    loss.backward()
    errors = {}
    for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
        dist.all_reduce(p.grad, group=mesh.context_group)  # the context ranks' shares
        errors[name] = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
    return {"loss": loss.item(), "expected": expected.item(), "errors": errors} if rank == 0 else None


def several(rank: int, world_size: int, cases: list) -> list:
    """Each case in turn, in the same processes: :func:`train` (item "trainer" or "sft") or
    :func:`causal_lm_loss_check` (item "causal_lm_loss")."""
    os.environ["OMP_NUM_THREADS"] = "1"  # accelerate would raise the thread count on CPU
    return [
        causal_lm_loss_check(rank, case) if case["item"] == "causal_lm_loss" else train(rank, case) for case in cases
    ]
