"""Ranks of the diffusers switch's tests: the switched transformer against the unmodified one.

``parity(rank, world, family, ulysses, ring, dtype_name, layout, batch, tokens, text)`` runs, on every
rank, the unmodified tiny transformer in float64 (the reference) and in ``dtype`` (the single-device
result), and the switched one in ``dtype`` on a ``ulysses x ring`` mesh; the loss is a fixed random
projection of the full output. Returns the max abs errors against float64 of the output and of every
parameter gradient (the switched gradients summed over the context ranks), for both runs.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hybridsp
from hybridsp.integrations import diffusers as hybrid_diffusers
from tests.helpers.models.diffusion import tiny_transformer, transformer_inputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _run(model: torch.nn.Module, inputs: dict, dtype: torch.dtype, weight: torch.Tensor):
    """(output, {name: grad}) of ``sum(out * weight)`` in float64 for comparison."""
    model.zero_grad(set_to_none=True)
    out = model(**_cast(inputs, dtype)).sample
    (out.double() * weight).sum().backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().double(), grads


def _errors(out, grads, ref_out, ref_grads) -> dict[str, float]:
    """Max abs errors against float64, relative to the largest reference value (output; every gradient)."""
    assert grads.keys() == ref_grads.keys(), (
        f"gradients differ in which parameters get one: {grads.keys() ^ ref_grads.keys()}"
    )
    grad_scale = max(float(g.abs().max()) for g in ref_grads.values())
    grad_err = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads) / grad_scale
    return {"out": float((out - ref_out).abs().max() / ref_out.abs().max()), "grad": grad_err}


def parity(
    rank: int,
    world: int,
    family: str,
    ulysses: int,
    ring: int,
    dtype_name: str,
    layout: str = "contiguous",
    batch: int = 2,
    tokens: int = 15,
    text: int = 5,
    hidden_text: int = 0,
    rows_differ: bool = False,
    per_token_timesteps: bool = False,
) -> dict[str, dict[str, float]]:
    dtype = DTYPES[dtype_name]
    base = tiny_transformer(family)
    shape = dict(batch=batch, tokens=tokens, text=text, hidden_text=hidden_text, rows_differ=rows_differ)
    inputs = transformer_inputs(family, **shape, per_token_timesteps=per_token_timesteps)
    reference = copy.deepcopy(base).double()
    ref_out, ref_grads = _run(reference, inputs, torch.float64, 1.0)
    weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref_out, ref_grads = _run(reference, inputs, torch.float64, weight)
    single = copy.deepcopy(base).to(dtype)
    single_out, single_grads = _run(single, inputs, dtype, weight)

    mesh = hybridsp.init_mesh(ulysses=ulysses, ring=ring, layout=layout)
    switched = copy.deepcopy(base).to(dtype)
    handle = hybrid_diffusers.apply(switched, mesh, backend="torch")
    out, grads = _run(switched, inputs, dtype, weight)
    for grad in grads.values():
        dist.all_reduce(grad, group=mesh.context_group)  # each rank's share -> the one-process gradient
    handle.undo()
    undone_out, _ = _run(switched, inputs, dtype, weight)
    assert torch.equal(undone_out, single_out), "undo() did not restore the unmodified model"
    return {
        "single": _errors(single_out, single_grads, ref_out, ref_grads),
        "switched": _errors(out, grads, ref_out, ref_grads),
    }


def parity_cases(rank: int, world: int, cases: list[tuple]) -> list[dict[str, dict[str, float]]]:
    """:func:`parity` of each case ``(family, ulysses, ring, dtype_name, layout, batch, tokens, text[, hidden_text,
    rows_differ, per_token_timesteps])`` in
    one launch (a mesh smaller than the world runs with data-parallel replicas beside it)."""
    return [parity(rank, world, *case) for case in cases]
