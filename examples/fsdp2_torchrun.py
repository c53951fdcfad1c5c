"""Hybrid Ulysses x ring sequence parallelism under PyTorch FSDP2, with no DeepSpeed and no Trainer.

    torchrun --nproc-per-node 4 examples/fsdp2_torchrun.py --ulysses 2 --ring 1     # DP 2 x U 2
    torchrun --nproc-per-node 4 examples/fsdp2_torchrun.py --ulysses 2 --ring 2 --family qwen3_moe
    python examples/fsdp2_torchrun.py --reference --dp 2                            # one process, unsharded

Every rank builds the same tiny model (``--family`` llama, qwen3_moe with its router loss, or
qwen3_5, a Qwen3.5-style hybrid of Gated DeltaNet and attention layers), switches its attention to
the mesh (``hf.apply``), shards it with ``fully_shard`` per decoder layer over the mesh's data x
context ranks (``fully_shard_model``: every parameter, gradient and AdamW state is a DTensor shard),
cuts each replica's batch with ``shard_batch`` and trains on the exact token-weighted loss of the
whole global batch, clipping the gradient norm. ``--reference`` runs the same steps on the
unmodified model in one process (each replica's batch a micro-batch of one optimizer step): the
losses, gradient norms and the clipped updates agree to fp32 rounding. ``--out FILE`` saves them
(and the final full parameters) for a comparison.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=6,
            linear_conv_kernel_dim=4,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
    ),
}
SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    attn_implementation="sdpa",
)


def build_model(family: str, seed: int = 0):
    """The tiny fp32 causal LM of ``family``, weights fixed by ``seed``."""
    import transformers

    config_class, model_class, fields = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SHAPE, **fields})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).float()


def global_batch(step: int, dp: int, batch: int, seq: int, vocab: int = 128) -> torch.Tensor:
    """input_ids [DP * B, S] of one optimizer step; replica d takes rows d*B:(d+1)*B."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(1, vocab, (dp * batch, seq), generator=gen)


def valid_targets(ids: torch.Tensor) -> int:
    """Targets of rows [B, S] after the shift (every token but the last of each row)."""
    return ids.shape[0] * (ids.shape[1] - 1)


def router_settings(model):
    """(coefficient, experts, top_k) of a model that adds a router loss, else None."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    return config.router_aux_loss_coef, config.num_experts, config.num_experts_per_tok


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """AdamW (its state sharded like the parameters) or plain SGD (a step linear in the clipped gradient)."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr)


# ---- the sharded run ---------------------------------------------------------------------


def rank_loss(model, mesh, ids: torch.Tensor, total: int, router) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's loss to backward, the replica's objective value) for its replica's rows ``ids`` [B, S].

    The objective is ``sum(CE of the global batch) / total + coef * aux / DP`` (aux: the replica's
    load-balancing loss, as a data-parallel run adds it per replica). The rank's loss is ``DP`` times
    its share of that (FSDP2 divides the summed gradient by ``DP``: Note [gradient scale under FSDP2]).
    """
    import hybridsp

    batch = {"input_ids": ids, "labels": ids}
    local = hybridsp.shard_batch(batch, mesh)
    out = model(
        input_ids=local["input_ids"],
        position_ids=local["position_ids"],
        hybridsp_documents=local["documents"],
        use_cache=False,
    )
    replica_mean = hybridsp.sharded_cross_entropy(out.logits, local["shift_labels"], mesh)  # the replica's mean
    weight = valid_targets(ids) / total
    loss = mesh.dp * weight * replica_mean
    value = weight * replica_mean.detach()
    if router is not None:
        coefficient, experts, top_k = router
        mask = hybridsp.real_token_mask(batch, mesh, local["documents"])  # [B, S_local]
        aux = hybridsp.sharded_load_balancing_loss(out.router_logits, mask, mesh, num_experts=experts, top_k=top_k)
        loss = loss + coefficient * aux
        value = value + coefficient * aux.detach() / mesh.dp
    return loss, value


def train_sharded(args) -> dict:
    import torch.distributed as dist

    import hybridsp
    from hybridsp.integrations import transformers as hf
    from hybridsp.integrations.fsdp import clip_grad_norm_, fully_shard_model, is_fully_sharded
    from hybridsp.launch import init_process_group

    init_process_group(backend="gloo" if not torch.cuda.is_available() else None)
    mesh = hybridsp.init_mesh(ulysses=args.ulysses, ring=args.ring)
    model = build_model(args.family)
    full_numel = sum(p.numel() for p in model.parameters())
    hf.apply(model, mesh)
    fully_shard_model(model, mesh)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    optimizer = make_optimizer(model, args)
    router = router_settings(model)
    losses, norms = [], []
    for step in range(args.steps):
        ids = global_batch(step, mesh.dp, args.batch, args.seq_len)
        mine = ids[mesh.dp_rank * args.batch : (mesh.dp_rank + 1) * args.batch]  # [B, S] this replica's rows
        loss, value = rank_loss(model, mesh, mine, valid_targets(ids), router)
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(value, group=mesh.data_group)  # the replicas' parts of the objective
        losses.append(float(value))
        norms.append(float(norm))
        if mesh.rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.6f} grad_norm {norms[-1]:.6f}", flush=True)
    params = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    sharded = torch.tensor([float(is_fully_sharded(model) and local_numel < full_numel)])
    dist.all_reduce(sharded, op=dist.ReduceOp.MIN)
    if mesh.rank == 0:
        print(
            f"{args.family} on {mesh!r}: every parameter a DTensor shard ({local_numel} of {full_numel} elements "
            f"on rank 0): {bool(sharded.item())}",
            flush=True,
        )
    return {"losses": losses, "grad_norms": norms, "params": params, "sharded": bool(sharded.item())}


# ---- the reference: one process, the unmodified model ----------------------------------------


def train_reference(args) -> dict:
    """The same steps on the unmodified model, unsharded: the replicas' rows as micro-batches."""
    model = build_model(args.family)
    optimizer = make_optimizer(model, args)
    router = router_settings(model)
    losses, norms = [], []
    for step in range(args.steps):
        ids = global_batch(step, args.dp, args.batch, args.seq_len)
        total, objective = valid_targets(ids), 0.0
        for rows in ids.split(args.batch):  # [B, S] each replica's micro-batch
            out = model(input_ids=rows, use_cache=False)
            logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])  # [B * (S-1), V]
            loss = F.cross_entropy(logits, rows[:, 1:].reshape(-1), reduction="sum") / total
            if router is not None:
                loss = loss + router[0] * out.aux_loss / args.dp
            loss.backward()
            objective += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(objective)
        print(f"step {step + 1}: loss {losses[-1]:.6f} grad_norm {norms[-1]:.6f}", flush=True)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params, "sharded": False}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--ulysses", type=int, default=2)
    parser.add_argument("--ring", type=int, default=1)
    parser.add_argument("--reference", action="store_true", help="one process, the unmodified model")
    parser.add_argument("--dp", type=int, default=1, help="replicas the reference stands for")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="rows per replica")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--max-grad-norm", type=float, default=0.5)
    parser.add_argument("--out", default=None, help="save losses, norms and final parameters (rank 0)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    result = train_reference(args) if args.reference else train_sharded(args)
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        torch.save(result, args.out)


if __name__ == "__main__":
    main()
