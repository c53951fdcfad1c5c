"""Compare one recorded pass (:func:`~hybridsp.integrations.transformers._probe_pass.probe_pass`) with plain math.

Per attention layer the rank gathers the layer's q/k/v, output and their gradients over the context
group (one ``all_gather`` of the packed tensors), takes its share of the key/value heads (head ``j``
on context rank ``j % C``) and runs the float64 reference and the same-dtype baseline on them
(:mod:`._reference`). The loss is recomputed in float64 from the logits (one ``all_reduce`` of two
numbers), and the logits' gradient at each target from it. The per-rank maxima then travel in one
``all_gather`` over the data x context group (and the tensor group), so every rank builds the same
:class:`~hybridsp.monitor._report.ParityReport`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from hybridsp.attention._api import gather_sequence
from hybridsp.mesh._hybrid_mesh import HybridMesh
from hybridsp.monitor._reference import attention_vjp
from hybridsp.monitor._report import DLOGITS_TOLERANCE, LOSS_TOLERANCE, QUANTITIES, ParityReport, ParityRow, tolerance

_STATS = 4  # per (layer, quantity): max |x - ref|, max |ref|, max |baseline - ref|, rank of the worst element


def compare_pass(record: dict, mesh: HybridMesh, *, factor: float = 2.0, rtol: float | None = None) -> ParityReport:
    """The report for ``record`` (see the module docstring); a collective over the mesh's groups."""
    calls = record["calls"]
    if not calls:
        raise ValueError("the probe saw no attention call: is the model switched with apply(model, mesh)?")
    dtype = calls[0]["q"].dtype
    where = _token_table(record, mesh)  # [B, S, 2]: position, ring slot of each gathered token
    stats = torch.zeros(len(calls) + 1, len(QUANTITIES), _STATS, dtype=torch.float64)
    for index, call in enumerate(calls):
        stats[index] = _layer_stats(call, where, record["documents"], mesh)
    stats[-1, :2] = _loss_stats(record, mesh)
    stats = _gather_stats(stats, mesh)  # [ranks, L + 1, Q, 4]
    rows = tuple(_row(call["layer"], stats[:, i], QUANTITIES, dtype, factor, rtol) for i, call in enumerate(calls))
    loss = _row(None, stats[:, -1, :2], ("loss", "dlogits"), dtype, factor, rtol)
    fixed = {"loss": LOSS_TOLERANCE, "dlogits": DLOGITS_TOLERANCE}
    tolerances = {name: rtol or table.get(dtype, table[torch.float32]) for name, table in fixed.items()}
    loss = dataclasses.replace(loss, tolerances=tolerances)
    return ParityReport(rows, loss, dtype, _describe(mesh))


def _describe(mesh: HybridMesh) -> str:
    return f"U={mesh.ulysses} x R={mesh.ring} (layout {mesh.layout}, kv_comm {mesh.kv_comm}, DP {mesh.dp})"


def _token_table(record: dict, mesh: HybridMesh) -> torch.Tensor:
    """[B, S, 2] int64: the position each gathered token was fed and the ring slot that held it."""
    positions = record["position_ids"]  # [B, S/C]
    local = torch.stack([positions, torch.full_like(positions, mesh.ring_rank)], dim=-1)  # [B, S/C, 2]
    return gather_sequence(local, mesh, cu_seqlens=record["documents"])  # [B, S, 2]


def _gathered(call: dict, documents, mesh: HybridMesh) -> dict[str, torch.Tensor]:
    """The call's eight tensors gathered over the context group in one collective, each [B, S, heads, dim]."""
    names = ("q", "k", "v", "out", "dq", "dk", "dv", "dout")
    tensors = [call[n] if call.get(n) is not None else torch.zeros_like(call[n[1:]]) for n in names]
    shapes = [t.shape[2:] for t in tensors]
    packed = torch.cat([t.to(call["q"].dtype).flatten(2) for t in tensors], dim=-1)  # [B, S/C, F]
    full = gather_sequence(packed, mesh, cu_seqlens=documents)  # [B, S, F]
    pieces = full.split([s.numel() for s in shapes], dim=-1)
    return {n: p.reshape(*p.shape[:2], *s) for n, p, s in zip(names, pieces, shapes)}  # [B, S, heads, dim]


def _layer_stats(call: dict, where: torch.Tensor, documents, mesh: HybridMesh) -> torch.Tensor:
    """[Q, 4] this rank's maxima for one layer over its share of key/value heads."""
    full = _gathered(call, documents, mesh)
    heads, kv_heads = full["q"].shape[2], full["k"].shape[2]
    group = heads // kv_heads
    stats = torch.zeros(len(QUANTITIES), _STATS, dtype=torch.float64)
    stats[:, 3] = -1
    for j in range(mesh.context_rank, kv_heads, mesh.context):
        q_heads = slice(j * group, (j + 1) * group)
        inputs = (full["q"][:, :, q_heads], full["k"][:, :, j], full["v"][:, :, j], full["dout"][:, :, q_heads])
        sinks = call.get("sinks")
        settings: dict[str, Any] = dict(
            scale=_scale(call, full["q"].shape[-1]),
            window=call.get("sliding_window"),
            chunk=call.get("chunk"),
            sinks=None if sinks is None else sinks[q_heads],
            softcap=call.get("softcap"),
        )
        reference = attention_vjp(*inputs, where[..., 0], dtype=torch.float64, **settings)
        baseline = attention_vjp(*inputs, where[..., 0], dtype=full["q"].dtype, **settings)
        sharded = (full["out"][:, :, q_heads], full["dq"][:, :, q_heads], full["dk"][:, :, j], full["dv"][:, :, j])
        for qi, (x, ref, base) in enumerate(zip(sharded, reference, baseline)):
            err, ref_max, base_err, (b, s, h) = _maxima(x, ref, base)
            head = j * group + (h if qi < 2 else 0)  # the query head whose Ulysses rank computed it
            rank = _rank_of(mesh, int(where[b, s, 1]), head, heads)
            if err > stats[qi, 0] or stats[qi, 3] < 0:
                stats[qi, 0], stats[qi, 3] = err, rank
            stats[qi, 1] = max(float(stats[qi, 1]), ref_max)
            stats[qi, 2] = max(float(stats[qi, 2]), base_err)
    return stats


def _scale(call: dict, head_dim: int) -> float:
    scale = call.get("softmax_scale")
    return float(scale) if scale is not None else head_dim**-0.5


def _maxima(x: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> tuple[float, float, float, tuple[int, ...]]:
    """(max |x - ref|, max |ref|, max |base - ref|, (b, s, head) of the first worst element); NaN counts as inf."""
    inf = float("inf")
    diff = (x.double() - ref).abs().nan_to_num(nan=inf, posinf=inf)  # [B, S, g?, D]
    flat = diff.reshape(*diff.shape[:2], -1) if diff.dim() == 4 else diff  # [B, S, g * D] or [B, S, D]
    index = int(flat.reshape(-1).argmax())
    b, rest = divmod(index, flat.shape[1] * flat.shape[2])
    s, column = divmod(rest, flat.shape[2])
    head = column // x.shape[-1] if diff.dim() == 4 else 0
    base_err = (base.double() - ref).abs().nan_to_num(nan=inf, posinf=inf).max()
    ref_max = ref.abs().nan_to_num(nan=0.0, posinf=0.0).max()
    return float(diff.max()), float(ref_max), float(base_err), (b, s, head)


def _rank_of(mesh: HybridMesh, slot: int, head: int, heads: int) -> int:
    """The global rank that computed query head ``head`` (of ``heads``) for a token of ring slot ``slot``."""
    per_rank = max(1, heads // mesh.ulysses)
    return mesh.shape.rank_of(mesh.dp_rank, slot, min(head // per_rank, mesh.ulysses - 1), mesh.tensor_rank)


def _loss_stats(record: dict, mesh: HybridMesh) -> torch.Tensor:
    """[2, 4]: the loss (|loss - ref|, |ref|) and the logits' gradient at the targets, against float64."""
    logits, labels, dlogits = record["logits"], record["shift_labels"], record["dlogits"]
    valid = labels != -100  # [B, S/C]
    target = labels.clamp_min(0).unsqueeze(-1)  # [B, S/C, 1]
    rows = max(1, (1 << 24) // max(1, logits.shape[-1]))
    flat, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1, 1)  # [B * S/C, V], [B * S/C, 1]
    lse = torch.cat([flat[i : i + rows].double().logsumexp(-1) for i in range(0, flat.shape[0], rows)])  # [B * S/C]
    picked = flat.gather(1, flat_target).double().squeeze(1)  # [B * S/C]
    mask = valid.reshape(-1)
    totals = torch.stack([((lse - picked) * mask).sum(), mask.sum().double()]).to(logits.device)  # [2]
    if mesh.context > 1:
        dist.all_reduce(totals, group=mesh.context_group)
    count = float(totals[1].clamp_min(1.0))
    reference_loss = float(totals[0]) / count
    stats = torch.zeros(2, _STATS, dtype=torch.float64)
    stats[:, 3] = mesh.rank
    loss_err = abs(float(record["loss"]) - reference_loss)
    stats[0, 0] = loss_err if loss_err == loss_err else float("inf")
    stats[0, 1] = abs(reference_loss)
    grad_ref = ((picked - lse).exp() - 1.0) / count * mask  # [B * S/C]
    grad = dlogits.reshape(-1, logits.shape[-1]).gather(1, flat_target).double().squeeze(1) * mask
    stats[1, 0] = float((grad - grad_ref).abs().nan_to_num(nan=float("inf")).max().cpu())
    stats[1, 1] = float(grad_ref.abs().max().cpu())
    return stats


def _gather_stats(stats: torch.Tensor, mesh: HybridMesh) -> torch.Tensor:
    """[ranks, L + 1, Q, 4]: every rank's ``stats`` over the data x context group and the tensor group."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else stats.device
    out = _all_gather(stats.to(device), mesh.data_context_group)
    if mesh.tensor > 1 and mesh.tensor_group is not None:
        out = _all_gather(out, mesh.tensor_group).flatten(0, 1)
    return out.cpu()


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.stack(parts)


def _row(layer: int | None, stats: torch.Tensor, names, dtype, factor: float, rtol: float | None) -> ParityRow:
    """One row from every rank's [ranks, Q, 4] maxima: global max error over global max reference."""
    errors, tolerances, baselines, ranks = {}, {}, {}, {}
    for qi, name in enumerate(names):
        column = stats[:, qi]  # [ranks, 4]
        worst = int(column[:, 0].argmax())
        ref = float(column[:, 1].max())
        err = float(column[:, 0].max())
        errors[name] = err / ref if ref > 0 else (0.0 if err == 0 else float("inf"))
        baselines[name] = float(column[:, 2].max()) / ref if ref > 0 else 0.0
        tolerances[name] = tolerance(dtype, baselines[name], factor, rtol)
        ranks[name] = int(column[worst, 3])
    return ParityRow(layer, errors, tolerances, baselines, ranks)
