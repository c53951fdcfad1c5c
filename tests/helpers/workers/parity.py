"""Distributed workers for tests/monitor/: the exactness probe on tiny switched models, clean and with one
injected fault at a time (:data:`FAULTS`). Each fault is a monkeypatch applied on the ranks it names and
undone before the next one, so one launch runs the clean probe and every fault.

A worker returns, per case, ``(ok, worst layer, worst quantity, worst rank, relative error, table)`` from
every rank (the tests check that every rank returned the same report).
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

FAULT_RANK = 1  # the rank a one-rank fault is injected on
NAN_LAYER = 1  # the layer whose attention output gets a NaN on FAULT_RANK


@contextmanager
def _patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


class _WrongKernel:
    """The torch kernel with a softmax scale 10% too large in its forward (a kernel wrong on one rank)."""

    def __init__(self):
        from hybridsp.kernels import TorchFusedKernel

        self._inner = TorchFusedKernel()
        self.name = self._inner.name

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, q, k, v, causal=True, softmax_scale=None, **kwargs):
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return self._inner.forward(q, k, v, causal=causal, softmax_scale=scale * 1.1, **kwargs)


def _wrong_kernel(mesh, model):
    from hybridsp.integrations.transformers import _binding

    stack = ExitStack()
    if mesh.rank == FAULT_RANK:
        for module in model.modules():
            binding = getattr(module, _binding.BINDING_ATTR, None)
            if binding is not None:
                stack.enter_context(
                    _patched(module, _binding.BINDING_ATTR, type(binding)(binding.mesh, _WrongKernel()))
                )
    return stack


def _nan_on_rank(mesh, model):
    from hybridsp.integrations.transformers import _switch

    original = _switch.hybrid_attn_func
    calls = []

    def with_nan(q, *args, **kwargs):
        out = original(q, *args, **kwargs)
        if len(calls) % model.config.num_hidden_layers == NAN_LAYER:
            heads = out.shape[2] // mesh.ulysses
            out = out.clone()
            out[0, 3, mesh.ulysses_rank * heads, 0] = float("nan")  # a head this rank's kernel computed
        calls.append(1)
        return out

    return _patched(_switch, "hybrid_attn_func", with_nan) if mesh.rank == FAULT_RANK else ExitStack()


def _stale_block(mesh, model):
    from hybridsp.attention._transport import p2p

    original = p2p.P2PTransport.blocks

    def stale(self):
        previous = None
        for block in original(self):
            if block.step == 1 and block.k is not None:  # the buffer read before this step's data arrived
                k = previous.k[:, : block.k.shape[1]] if previous is not None else torch.zeros_like(block.k)
                v = previous.v[:, : block.v.shape[1]] if previous is not None else torch.zeros_like(block.v)
                block = type(block)(block.pieces, k, v, block.offset, block.own, block.step, block.chunk_rows)
            previous = block
            yield block

    return _patched(p2p.P2PTransport, "blocks", stale) if mesh.rank == FAULT_RANK else ExitStack()


def _double_permutation(mesh, model):
    from hybridsp.data import _batch
    from hybridsp.layout._layouts import layout_permutation

    original = _batch.shard_tensors

    def twice(tensors, mesh_, **kwargs):
        perm = layout_permutation(tensors[0].shape[1], mesh_.ring, mesh_.ulysses, mesh_.token_layout)
        return original([t[:, perm] for t in tensors], mesh_, **kwargs)

    return _patched(_batch, "shard_tensors", twice)


def _local_denominator(mesh, model):
    from hybridsp.losses import _cross_entropy

    original = _cross_entropy.token_weighted_share

    def local(local_sum, safe_labels, bad, shift_labels, mesh_, **kwargs):
        count = (safe_labels != kwargs["ignore_index"]).sum()
        return original(local_sum, safe_labels, bad, shift_labels, mesh_, **kwargs, denominator=count)

    return _patched(_cross_entropy, "token_weighted_share", local)


FAULTS = {
    "wrong_kernel": _wrong_kernel,
    "nan_on_rank": _nan_on_rank,
    "stale_block": _stale_block,
    "double_permutation": _double_permutation,
    "local_denominator": _local_denominator,
}


def probe_cases(rank, world, ulysses, ring, family, dtype, seeds, faults, fields=None, batch_spec=None):
    """The probe on ``family`` (tests/helpers/models/switched.py), once per seed clean, then once per fault."""
    import hybridsp
    from hybridsp.integrations import transformers as hf
    from tests.helpers.models.switched import build, make_batch

    mesh = hybridsp.init_mesh(ulysses, ring)
    seq, lengths = batch_spec or (48, (48, 40))
    results = {}
    for seed in seeds:
        model = build(family, seed=seed, **(fields or {})).to(dtype)
        hf.apply(model, mesh, backend="torch")
        report = hybridsp.verify_parity(model, mesh, make_batch(seq, lengths, seed=seed))
        results[f"clean{seed}"] = _summary(report)
    for fault in faults:
        with FAULTS[fault](mesh, model):
            report = hybridsp.verify_parity(model, mesh, make_batch(seq, lengths, seed=0))
        results[fault] = _summary(report)
    return results


def _summary(report) -> tuple:
    worst = report.worst
    return (report.ok, worst.layer, worst.quantity, worst.rank, worst.rel_error, report.table())


def health_steps(rank, world, ulysses, ring, layout, sleeper, nan_rank):
    """Three training-like steps of a tiny switched model under :class:`hybridsp.monitor.RunMonitor`; rank
    ``sleeper`` sleeps 2 s in each step, rank ``nan_rank`` puts a NaN into layer NAN_LAYER's attention output
    in the last step (-1: nobody). Returns every step's metrics."""
    import time

    import hybridsp
    from hybridsp.integrations import transformers as hf
    from hybridsp.monitor import MonitorConfig, RunMonitor
    from tests.helpers.models.switched import build, make_batch

    mesh = hybridsp.init_mesh(ulysses, ring, layout=layout)
    model = build("qwen2", num_hidden_layers=3)
    hf.apply(model, mesh, backend="torch")
    monitor = RunMonitor(model, mesh, MonitorConfig(parity_every=0))
    found = []
    for step in range(3):
        local = hybridsp.shard_batch(make_batch(48, (48, 48), seed=step), mesh)
        fault = _nan_on_rank(mesh, model) if step == 2 and rank == nan_rank else ExitStack()
        monitor.begin_step()
        with fault:
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        hybridsp.sharded_cross_entropy(logits, local["shift_labels"], mesh).backward()
        if rank == sleeper:
            time.sleep(2.0)
        metrics, _ = monitor.end_step(step, 1.0, position_ids=local["position_ids"])
        found.append(metrics)
    monitor.close()
    return found
