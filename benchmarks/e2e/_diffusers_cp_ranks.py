"""The ranks of e2e.diffusers_cp: one random Wan transformer, three ways, measured side by side in one process group.

Every rank builds the same random ``WanTransformer3DModel`` and the same full inputs (a video latent
[1, C, F, H, W], a timestep, text [1, T_text, 64]) and makes one copy of the model per method:

- ``one process``: unmodified, run on rank 0 alone (the other ranks wait), the baseline and reference;
- ``hybridsp UaxRb``: ``hybridsp.integrations.diffusers.apply`` on a ``U x R`` mesh (contiguous layout,
  ``backend="torch"``: the aten CPU flash kernel);
- ``diffusers UaxRb``: ``enable_parallelism(ContextParallelConfig(ulysses_degree=U, ring_degree=R))`` with
  the ``_native_flash`` backend, whose CUDA op gets the same aten CPU flash kernel (``_diffusers_cpu``);
- ``diffusers U2xR1 (native)``: its Ulysses with the ``native`` (SDPA) backend, the one path that runs here
  without a kernel stand-in (its backward recomputes the forward).

Two steps per method: ``train`` (forward, MSE against a fixed target, backward; gradients set to None
first) and ``sample`` (one forward under ``no_grad``, a sampler's step). Passes, in this order: warm-up,
errors against the one-process run (output; gradients summed over the context ranks), bytes sent
(``_diffusers_cpu.SentBytes``; hybridsp's own ``CommCounter`` beside it), peak memory (``harness.Allocations``,
torch's allocations inside the step, a few times), and time (``harness.interleave``: rotating order, a barrier before
each call).
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks.common import harness

ONE = "one process"
TEXT_DIM = 64
CHANNELS = 16  # latent channels (Wan 2.1's)


@dataclass(frozen=True)
class Shape:
    """The model and inputs: ``frames`` x ``size`` x ``size`` latent (patch 1 x 2 x 2), ``text`` text tokens."""

    frames: int
    size: int
    text: int
    heads: int
    head_dim: int
    layers: int

    @property
    def video_tokens(self) -> int:
        return self.frames * (self.size // 2) ** 2


@dataclass
class Method:
    name: str
    model: torch.nn.Module
    everywhere: bool  # False: rank 0 alone (the one-process baseline)
    mesh: Any = None  # hybridsp's mesh (its CommCounter)


def build_model(shape: Shape) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    inner = shape.heads * shape.head_dim
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=shape.heads, attention_head_dim=shape.head_dim,
        in_channels=CHANNELS, out_channels=CHANNELS, text_dim=TEXT_DIM, freq_dim=TEXT_DIM, ffn_dim=4 * inner,
        num_layers=shape.layers, cross_attn_norm=True, rope_max_seq_len=max(64, shape.frames, shape.size),
    )  # fmt: skip


def make_batch(shape: Shape) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs, target): the full inputs every rank gets and the training target [1, C, F, H, W]."""
    generator = torch.Generator().manual_seed(1)
    latent = torch.randn(1, CHANNELS, shape.frames, shape.size, shape.size, generator=generator)
    inputs = {
        "hidden_states": latent,
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, shape.text, TEXT_DIM, generator=generator),
    }
    return inputs, torch.randn(latent.shape, generator=generator)


def build_methods(base: torch.nn.Module, world: int, degrees: list[tuple[int, int]], native: bool) -> list[Method]:
    import hybridsp
    from benchmarks.e2e._diffusers_cpu import enable_context_parallel
    from hybridsp.integrations import diffusers as hybrid_diffusers

    methods = [Method(ONE, copy.deepcopy(base), everywhere=False)]
    for ulysses, ring in degrees:
        assert ulysses * ring == world, "each mesh is the whole world (C = W)"
        tag = f"U{ulysses}xR{ring}"
        mesh = hybridsp.init_mesh(ulysses=ulysses, ring=ring, layout="contiguous")
        switched = copy.deepcopy(base)
        hybrid_diffusers.apply(switched, mesh, backend="torch")
        methods.append(Method(f"hybridsp {tag}", switched, everywhere=True, mesh=mesh))
        theirs = copy.deepcopy(base)
        enable_context_parallel(theirs, ulysses, ring, "_native_flash")
        methods.append(Method(f"diffusers {tag}", theirs, everywhere=True))
        if native and ring == 1:
            plain = copy.deepcopy(base)
            enable_context_parallel(plain, ulysses, ring, "native")
            methods.append(Method(f"diffusers {tag} (native)", plain, everywhere=True))
    return methods


def _forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs, return_dict=False)[0]  # [1, C, F, H, W], full on every rank


def steps(method: Method, rank: int, inputs: dict, target: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """``train`` and ``sample`` of ``method`` on this rank (no-ops off rank 0 for the one-process run)."""

    def train() -> torch.Tensor:
        method.model.zero_grad(set_to_none=True)
        out = _forward(method.model, inputs)
        torch.nn.functional.mse_loss(out, target).backward()
        return out.detach()

    def sample() -> torch.Tensor:
        with torch.no_grad():
            return _forward(method.model, inputs)

    if not method.everywhere and rank != 0:
        return {"train": lambda: None, "sample": lambda: None}
    return {"train": train, "sample": sample}


def _errors(method: Method, out: torch.Tensor, reference: dict | None) -> dict[str, float]:
    """Output and gradient errors relative to the largest one-process value (rank 0; gradients summed first)."""
    grads = {n: p.grad for n, p in method.model.named_parameters() if p.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad)  # each rank's share -> the one-process gradient (the context group is the world)
    if reference is None:
        return {}
    ref_out, ref_grads = reference["out"], reference["grads"]
    assert grads.keys() == ref_grads.keys(), grads.keys() ^ ref_grads.keys()
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    return {
        "out": float((out - ref_out).abs().max() / ref_out.abs().max()),
        "grad": max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads) / scale,
    }


def verify(methods: list[Method], rank: int, inputs: dict, target: torch.Tensor) -> dict[str, dict[str, float]]:
    """Each sharded method's errors against the one-process run (filled on rank 0)."""
    reference = None
    if rank == 0:
        one = methods[0]
        out = steps(one, rank, inputs, target)["train"]()
        reference = {"out": out, "grads": {n: p.grad.clone() for n, p in one.model.named_parameters()}}
    found = {}
    for method in methods[1:]:
        out = steps(method, rank, inputs, target)["train"]()
        found[method.name] = _errors(method, out, reference)
        method.model.zero_grad(set_to_none=True)
    return found


def count_bytes(methods: list[Method], rank: int, inputs: dict, target: torch.Tensor) -> dict[str, dict]:
    """Bytes this rank sends in each step of each sharded method, by kind; hybridsp's attention counter beside."""
    from benchmarks.e2e._diffusers_cpu import SentBytes
    from hybridsp import CommCounter

    found: dict[str, dict] = {}
    for method in methods[1:]:
        for step, call in steps(method, rank, inputs, target).items():
            if method.mesh is not None:
                method.mesh.comm_counter = CommCounter()
            with SentBytes() as sent:
                call()
            found[f"{method.name} | {step}"] = {
                "bytes": dict(sent.bytes),
                "hybridsp_counter": dict(method.mesh.comm_counter.bytes_sent) if method.mesh is not None else None,
            }
            if method.mesh is not None:
                method.mesh.comm_counter = None
    return found


def measure_memory(
    methods: list[Method], rank: int, inputs: dict, target: torch.Tensor, repeats: int
) -> dict[str, list[int] | None]:
    """Peak bytes torch allocated inside each step of each method on this rank, ``repeats`` times (None: not
    run here). Repeated because a rank's peak moves by a few MiB with the timing of its communication."""
    found: dict[str, list[int] | None] = {}
    for method in methods:
        for step, call in steps(method, rank, inputs, target).items():
            key = f"{method.name} | {step}"
            found[key] = None if not method.everywhere and rank != 0 else []
            for _ in range(repeats if found[key] is not None else 0):
                gc.collect()
                with harness.Allocations() as allocations:
                    call()
                found[key].append(allocations.peak)  # type: ignore[union-attr]
    return found


def rank_main(
    rank: int, world: int, shape: Shape, degrees: list[tuple[int, int]], repeats: int, memory_repeats: int, native: bool
) -> dict[str, Any]:
    """Every pass on this rank; the parts the report combines over the ranks."""
    from benchmarks.e2e._diffusers_cpu import cpu_flash_kernel

    warnings.filterwarnings("ignore")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    with cpu_flash_kernel():
        inputs, target = make_batch(shape)
        methods = build_methods(build_model(shape), world, degrees, native)
        calls = {
            f"{method.name} | {step}": call
            for method in methods
            for step, call in steps(method, rank, inputs, target).items()
        }
        for call in calls.values():  # warm-up
            call()
        errors = verify(methods, rank, inputs, target)
        sent = count_bytes(methods, rank, inputs, target)
        memory = measure_memory(methods, rank, inputs, target, memory_repeats)
        times = harness.interleave(calls, repeats)
    return {"methods": [m.name for m in methods], "errors": errors, "bytes": sent, "memory": memory, "times": times}
