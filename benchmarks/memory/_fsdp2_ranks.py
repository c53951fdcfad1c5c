"""The four set-ups of ``memory.fsdp2`` and what one rank measures of each (runs inside a gloo rank).

Every set-up trains the same small Llama (``SHAPE``, fp32, seed 0) on the same row of S tokens with
AdamW, and exposes the same five things: ``forward_backward()`` (this rank's loss, backward done, the
loss value returned), ``step()`` (the optimizer step, gradients cleared), and the bytes this rank holds
of the parameters, gradients and optimizer state (local shards only: ``DTensor.to_local()``,
ZeRO-3's partitioned ``ds_tensor``, its local gradient partition, its flat optimizer partitions).

- ``one``: the unmodified model in one process (the whole model; the loss reference);
- ``plain``: ``torch.distributed.fsdp.fully_shard`` per decoder layer and root over a 1-D DeviceMesh of
  all ranks, no sequence parallelism: every rank runs the whole row (a plain FSDP2 user with one row and
  no context parallelism has nothing else to split);
- ``fsdp2``: hybridsp + FSDP2 (``init_mesh``, ``hf.apply``, ``fully_shard_model``), each rank S / C tokens;
- ``zero3``: ``hybridsp.integrations.deepspeed.initialize`` at ZeRO-3, each rank S / C tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import harness

SHAPE = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=640,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    attn_implementation="sdpa",
)
LR = 1e-3
BUCKET = 5_000_000  # ZeRO-3 reduce / prefetch bucket elements (DeepSpeed's default reduce bucket: 5e8 elements)
KINDS = ("one", "plain", "fsdp2", "zero3")


def build_model(seq: int):
    """The fp32 Llama of ``SHAPE`` (untied embeddings), weights fixed by seed 0."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=seq)
    return transformers.LlamaForCausalLM(config).float()


def make_row(seq: int) -> torch.Tensor:
    """input_ids [1, S]: the one row of the global batch, the same on every rank."""
    return torch.randint(1, SHAPE["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))


def local_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of this rank's part of ``tensor`` (a DTensor's local shard; a plain tensor whole; None 0)."""
    from torch.distributed.tensor import DTensor

    if tensor is None:
        return 0
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (AdamW: exp_avg, exp_avg_sq, step), local shards."""
    return sum(
        local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


@dataclass
class Setup:
    """One way of training the model on one rank: the loss step, the optimizer step, the bytes held."""

    forward_backward: Callable[[], float]
    step: Callable[[], None]
    params: Callable[[], int]
    grads: Callable[[], int]
    states: Callable[[], int]
    masters: Callable[[], int]  # a separate copy of the parameter shards the optimizer updates (0: none)
    tokens: int  # tokens this rank runs the model on
    shards_over: int  # ranks the parameters are sharded over (1: not sharded)


def _full_row_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the whole row [1, S] (the unmodified model's logits [1, S, V])."""
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[0, :-1], ids[0, 1:])


Losses = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # () -> (the loss to backpropagate, the loss to report)


def _autograd_setup(model, loss_of_step: Losses, tokens: int, shards_over: int) -> Setup:
    """A model trained by plain torch autograd and AdamW: ``loss_of_step()``'s first loss is backpropagated, its
    second reported; parameters, gradients and state counted by their local shards."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def forward_backward() -> float:
        backpropagated, reported = loss_of_step()
        backpropagated.backward()
        return float(reported.detach())

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Setup(
        forward_backward,
        step,
        params=lambda: sum(local_bytes(p) for p in model.parameters()),
        grads=lambda: sum(local_bytes(p.grad) for p in model.parameters()),
        states=lambda: state_bytes(optimizer),
        masters=lambda: 0,  # AdamW updates the (DTensor) parameters in place
        tokens=tokens,
        shards_over=shards_over,
    )


def _torch_setup(model, ids: torch.Tensor, shards_over: int) -> Setup:
    """The whole row on this rank (one process, plain FSDP2)."""

    def loss_of_step() -> tuple[torch.Tensor, torch.Tensor]:
        loss = _full_row_loss(model, ids)
        return loss, loss

    return _autograd_setup(model, loss_of_step, int(ids.shape[1]), shards_over)


def one_process(world: int, seq: int) -> Setup:
    return _torch_setup(build_model(seq), make_row(seq), shards_over=1)


def plain_fsdp2(world: int, seq: int) -> Setup:
    """fully_shard per decoder layer, then the root, over a 1-D mesh of all ranks; every rank the whole row.

    gloo has no AVG / PREMUL_SUM reduce-scatter: FSDP2 is told to sum, then divide by W (its own option).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = build_model(seq)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if dist.get_backend() == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return _torch_setup(model, make_row(seq), shards_over=mesh.size())


def hybrid_fsdp2(world: int, seq: int, ulysses: int, ring: int) -> Setup:
    """examples/fsdp2_torchrun.py's loop: init_mesh, hf.apply, fully_shard_model, shard_batch, the loss."""
    import hybridsp
    from hybridsp.integrations import transformers as hf
    from hybridsp.integrations.fsdp import fully_shard_model

    model = build_model(seq)
    mesh = hybridsp.init_mesh(ulysses=ulysses, ring=ring)
    hf.apply(model, mesh)
    fully_shard_model(model, mesh)
    ids = make_row(seq)  # the replica's rows [1, S]; DP = 1 here, so the global batch too
    local = hybridsp.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    weight = 1.0  # the replica's targets / the global batch's: one replica (DP 1) holds the whole batch

    def loss_of_step() -> tuple[torch.Tensor, torch.Tensor]:
        out = model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            hybridsp_documents=local["documents"],
            use_cache=False,
        )
        loss = hybridsp.sharded_cross_entropy(out.logits, local["shift_labels"], mesh)  # the replica's mean
        return mesh.dp * weight * loss, loss

    return _autograd_setup(model, loss_of_step, int(local["input_ids"].numel()), mesh.fsdp_mesh.size())


def zero3_config(ulysses: int, ring: int) -> dict:
    """ZeRO-3 with the "hybridsp" section; every parameter partitioned (persistence threshold 0)."""
    return {
        "hybridsp": {"ulysses": ulysses, "ring": ring},
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": BUCKET,
            "stage3_prefetch_bucket_size": BUCKET,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def hybrid_zero3(world: int, seq: int, ulysses: int, ring: int) -> Setup:
    """hybridsp.integrations.deepspeed.initialize at ZeRO-3 with torch's AdamW (as the tests call it)."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_local_grad

    import hybridsp
    from hybridsp.integrations import deepspeed as hds

    model = build_model(seq)
    engine, ds_optimizer, mesh, _ = hds.initialize(
        model, zero3_config(ulysses, ring), optimizer=torch.optim.AdamW(model.parameters(), lr=LR)
    )
    ids = make_row(seq)
    local = hybridsp.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    params = list(engine.module.parameters())

    def forward_backward() -> float:
        out = engine(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            hybridsp_documents=local["documents"],
            use_cache=False,
        )
        loss = hybridsp.sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
        engine.backward(loss)
        return float(loss.detach())

    def held() -> int:  # the partition, plus a whole parameter wherever one is left gathered
        return sum(local_bytes(p.ds_tensor) + local_bytes(p.data) for p in params)

    return Setup(
        forward_backward,
        engine.step,  # DeepSpeed's step: optimizer step and its own zero_grad
        params=held,
        grads=lambda: sum(local_bytes(safe_get_local_grad(p)) for p in params),
        states=lambda: state_bytes(ds_optimizer.optimizer),
        masters=lambda: master_copy_bytes(ds_optimizer),
        tokens=int(local["input_ids"].numel()),
        shards_over=min(dist.get_world_size(p.ds_process_group) for p in params),
    )


def master_copy_bytes(ds_optimizer) -> int:
    """Bytes of ZeRO-3's fp32 partitions that are not the parameter partitions themselves.

    DeepSpeed 0.19.8 aliases them when the partitions are already fp32 on its device, but compares
    ``tensor.device == self.device`` with ``self.device`` a string, which torch answers False: it copies.
    """
    own = {t.untyped_storage().data_ptr() for t in ds_optimizer.fp16_partitioned_groups_flat}
    return sum(
        t.untyped_storage().nbytes()
        for t in ds_optimizer.fp32_partitioned_groups_flat
        if t.untyped_storage().data_ptr() not in own
    )


def setup_for(kind: str, world: int, seq: int, ulysses: int, ring: int) -> Setup:
    if kind == "one":
        return one_process(world, seq)
    if kind == "plain":
        return plain_fsdp2(world, seq)
    if kind == "fsdp2":
        return hybrid_fsdp2(world, seq, ulysses, ring)
    return hybrid_zero3(world, seq, ulysses, ring)


def measure(rank: int, world: int, kind: str, seq: int, ulysses: int, ring: int) -> dict:
    """One rank: the bytes held after set-up, after the first backward and after the first step; the
    second step's peak of torch allocations (forward, loss, backward, optimizer step) and both losses."""
    import time

    import torch.distributed as dist

    started = time.perf_counter()
    setup = setup_for(kind, world, seq, ulysses, ring)
    result = {"kind": kind, "rank": rank, "tokens": setup.tokens, "shards_over": setup.shards_over}
    result["params"] = setup.params()
    result["loss_1"] = setup.forward_backward()
    result["grads"] = setup.grads()
    setup.step()
    result["states"] = setup.states()
    result["masters"] = setup.masters()
    result["live_before_step_2"] = harness.live_tensor_bytes()  # everything held between steps
    dist.barrier()
    with harness.Allocations() as allocations:
        result["loss_2"] = setup.forward_backward()
        setup.step()
    result["step_peak"] = allocations.peak
    result["seconds"] = time.perf_counter() - started
    return result
