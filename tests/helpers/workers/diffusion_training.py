"""Ranks of the diffusers switch's training and sampling tests (tiny Wan, fp32).

``fsdp2_trajectory``: a few flow-matching steps (the loss of diffusers' training examples:
``x_t = (1 - s) x0 + s noise``, target ``noise - x0``, mean squared error) with AdamW, the switched
transformer sharded by torch's ``fully_shard`` over the whole world (each rank's loss scaled by C so that
the world average is the sum of the context ranks' shares); returns the losses and the final parameters, to compare
with one process running the unmodified transformer.

``sampling``: a few steps of diffusers' ``FlowMatchEulerDiscreteScheduler`` over the switched
transformer; returns the final latents.
"""

from __future__ import annotations

import copy

import torch

import hybridsp
from hybridsp.integrations import diffusers as hybrid_diffusers
from tests.helpers.models.diffusion import tiny_transformer, transformer_inputs


def flow_matching_loss(model: torch.nn.Module, batch: dict, step: int) -> torch.Tensor:
    """diffusers' rectified-flow training loss on ``batch`` (clean latents in ``hidden_states``)."""
    generator = torch.Generator().manual_seed(100 + step)
    latents = batch["hidden_states"]
    noise = torch.randn(latents.shape, generator=generator)
    sigma = torch.rand(latents.shape[0], generator=generator).view(-1, *[1] * (latents.ndim - 1))
    noisy = (1 - sigma) * latents + sigma * noise
    pred = model(**{**batch, "hidden_states": noisy, "timestep": sigma.flatten() * 1000}).sample
    return torch.nn.functional.mse_loss(pred.float(), (noise - latents).float())


def train(model: torch.nn.Module, steps: int, grad_scale: float = 1.0) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batch = transformer_inputs("wan", batch=2, tokens=15, text=5, seed=step)
        loss = flow_matching_loss(model, batch, step)
        (loss * grad_scale).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def one_process_trajectory(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = tiny_transformer("wan", layers=1)
    return train(model, steps), {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdp2_trajectory(
    rank: int, world: int, ulysses: int, ring: int, steps: int
) -> tuple[list[float], dict[str, torch.Tensor], bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = tiny_transformer("wan", layers=1)
    mesh = hybridsp.init_mesh(ulysses=ulysses, ring=ring, layout="contiguous")
    handle = hybrid_diffusers.apply(model, mesh)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    # fully_shard averages over the world; the context ranks' shares must be summed (gloo has no
    # pre-multiplied sum for set_gradient_divide_factor), so each rank's loss is scaled by C
    losses = train(model, steps, grad_scale=float(mesh.context))
    final = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    handle.undo()
    return losses, final, sharded


def sampling(rank: int, world: int, ulysses: int, ring: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(unswitched, switched) final latents of ``steps`` Euler flow-matching steps from the same noise."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model = tiny_transformer("wan", layers=1)
    inputs = transformer_inputs("wan", batch=2, tokens=15, text=5, seed=3)

    def sample(transformer: torch.nn.Module) -> torch.Tensor:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(steps)
        latents = inputs["hidden_states"]  # the starting noise [B, C, F, H, W]
        with torch.no_grad():
            for t in scheduler.timesteps:
                velocity = transformer(**{**inputs, "hidden_states": latents, "timestep": t.expand(2)}).sample
                latents = scheduler.step(velocity, t, latents).prev_sample
        return latents

    plain = sample(model)
    switched = copy.deepcopy(model)
    handle = hybrid_diffusers.apply(switched, hybridsp.init_mesh(ulysses=ulysses, ring=ring))
    result = sample(switched)
    handle.undo()
    return plain, result


def deepspeed_trajectory(
    rank: int, world: int, stage: int, steps: int, scratch: str
) -> tuple[list[float], torch.Tensor]:
    """The same steps under ``hybridsp.integrations.deepspeed.initialize`` (ZeRO ``stage``, U = world) with
    the diffusers switch as its attention switch; returns the losses and the final parameters (flat)."""
    from hybridsp.integrations import deepspeed as hds
    from tests.helpers.deepspeed_engines import forbid_jit_builds, full_params

    forbid_jit_builds(scratch)
    model = tiny_transformer("wan", layers=1)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    engine, _, _, undo = hds.initialize(
        model,
        config,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        ulysses=world,
        ring=1,
        switch_attention=lambda m, mesh, backend: hybrid_diffusers.apply(m, mesh, backend=backend or "auto").undo,
    )
    losses = []
    for step in range(steps):
        batch = transformer_inputs("wan", batch=2, tokens=15, text=5, seed=step)
        loss = flow_matching_loss(engine, batch, step)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    params = full_params(engine)
    undo()
    return losses, params
