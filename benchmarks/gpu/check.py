"""The prepared accelerator check: one command, under 8 minutes on one H200.

    python -m benchmarks run gpu.check [--out DIR] [--quick]

1. Correctness of the ``flash`` backend (and PyTorch's CUDA ``torch`` backend) against the
   fp32 ``reference`` kernel, bf16 and fp16, causal and not, MHA and GQA, forward and
   backward: each error is judged by flash-attn's rule (at most twice the error of plain
   attention math done by PyTorch in the same dtype), and fp32 is shown to be refused
   with a clear error by flash.
2. The cost of ring blocking: attention over S tokens computed as the R zigzag ring
   schedules (every rank's blocks, run one after another in this one process, merged by
   LSE) against one kernel call on the full sequence, forward+backward, as a time ratio.
   A ratio near 1 means blocking and merging cost nothing beyond the kernel itself.
3. Activation-checkpoint offload (``hybridsp.offload_activations``): a Llama with HF
   activation checkpointing, one training forward + backward with and without offload: the
   loss must be identical and the gradients too (on CUDA within twice the run-to-run difference
   of its non-deterministic backward kernels), every layer input but the newest must go to host,
   and the peak memory must drop by about the bytes offloaded (pinned host buffers, side stream);
   step times side by side (overlap).
5. Head chunks (:mod:`benchmarks.gpu.head_chunks`): the kernel's share of ``head_chunks = G``, and
   ``hybrid_attn_func`` at world size 1 for each G against fp32 reference math, with peaks.
4. Lean norms (``hybridsp.apply_lean_norms``): the same checkpointed Llama, one forward + backward
   with HF's RMSNorms and with lean ones: the loss must be identical (the forward is bit-identical),
   the gradients equal to rounding, and the peak memory must not rise (the planner's term:
   ``hybridsp.planner._memory.norm_bytes_per_token``: 4 h bytes per token and norm less).
Without CUDA it runs the same code on the CPU ``torch`` backend (small sizes), so the
script itself is tested anywhere. Writes ``gpu_check.json`` and ``gpu_check.md`` to --out
(default ``benchmarks/results/gpu_check/``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import harness
from benchmarks.gpu import _timing, head_chunks
from hybridsp.attention._merge import merge_into
from hybridsp.kernels import get_kernel
from hybridsp.kernels._reference import attention_in_input_dtype
from hybridsp.layout._block_plan import build_plan


def _fwd_bwd(kernel, q, k, v, dout, causal, scale):
    out, lse = kernel.forward(q, k, v, causal=causal, softmax_scale=scale)
    return (out, *kernel.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale))


def correctness(device, backends, quick: bool) -> list[dict]:
    """Each backend's errors against fp32 reference math, next to the reference in the same dtype."""
    rows = []
    reference = get_kernel("reference")
    seq = 128 if quick else 2048
    for dtype in (torch.bfloat16, torch.float16):
        for causal, kv_heads in ((False, 8), (True, 8), (True, 2)):
            q, k, v, dout = _timing.inputs(2, seq, 8, kv_heads, 128, dtype, device)
            scale = 1 / math.sqrt(128)
            truth = _fwd_bwd(reference, *(t.float() for t in (q, k, v, dout)), causal, scale)
            floor = [
                _timing.relative_error(a, b)
                for a, b in zip(attention_in_input_dtype(q, k, v, dout, causal=causal, softmax_scale=scale), truth)
            ]
            for name in backends:
                errors = [
                    _timing.relative_error(a, b)
                    for a, b in zip(_fwd_bwd(get_kernel(name), q, k, v, dout, causal, scale), truth)
                ]
                rows.append(
                    {
                        "backend": name,
                        "dtype": str(dtype),
                        "causal": causal,
                        "kv_heads": kv_heads,
                        "errors_out_dq_dk_dv": errors,
                        "same_dtype_math": floor,
                        "ok": all(e <= 2 * f for e, f in zip(errors, floor)),
                    }
                )
    return rows


def _blocked_fwd_bwd(kernel, q, k, v, dout, ring: int, scale: float):
    """Causal attention as every ring rank's zigzag blocks in one process, merged by LSE."""
    local = q.shape[1] // ring
    chunks = [
        torch.cat(
            [t.narrow(1, r * local // 2, local // 2), t.narrow(1, (2 * ring - 1 - r) * local // 2, local // 2)], 1
        )
        for t in (q, k, v, dout)
        for r in range(ring)
    ]
    qs, ks, vs, douts = (chunks[i * ring : (i + 1) * ring] for i in range(4))
    for rank in range(ring):
        out = torch.zeros(qs[rank].shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], local), -math.inf, device=q.device)
        plan = build_plan(q.shape[1], ring, "zigzag", causal=True, docs=None, window=None, batch=q.shape[0])
        pieces = [
            (src, (p.rows, p.keys, p.kind == "causal"))
            for step in range(ring)
            for src in [(rank - step) % ring]
            for p in plan.pieces[(rank, src)]
        ]
        for src, (rows, keys, causal) in pieces:
            block_out, block_lse = kernel.forward(
                qs[rank][:, rows], ks[src][:, keys], vs[src][:, keys], causal=causal, softmax_scale=scale
            )
            merge_into(out[:, rows], lse[:, :, rows], block_out, block_lse)
        final = out.to(q.dtype)
        for src, (rows, keys, causal) in pieces:
            kernel.backward(
                douts[rank][:, rows],
                qs[rank][:, rows],
                ks[src][:, keys],
                vs[src][:, keys],
                final[:, rows],
                lse[:, :, rows],
                causal=causal,
                softmax_scale=scale,
            )


def ring_blocking_cost(device, backend: str, quick: bool) -> list[dict]:
    """Time of R-way zigzag blocking + merges vs one call on the whole sequence (fwd+bwd)."""
    kernel = get_kernel(backend)
    dtype = torch.bfloat16
    rows = []
    lengths = (1024,) if quick else (8192, 32768, 131072)
    for seq in lengths:
        q, k, v, dout = _timing.inputs(
            1, seq, 32 if device.type == "cuda" else 4, 8 if device.type == "cuda" else 2, 128, dtype, device
        )
        scale = 1 / math.sqrt(128)
        repeats = 3 if quick else 5
        single = _timing.timed(lambda: _fwd_bwd(kernel, q, k, v, dout, True, scale), device, repeats)
        for ring in (2, 4, 8):
            blocked = _timing.timed(lambda: _blocked_fwd_bwd(kernel, q, k, v, dout, ring, scale), device, repeats)
            rows.append(
                {
                    "backend": backend,
                    "seq_len": seq,
                    "ring": ring,
                    "single_s": single,
                    "blocked_s": blocked,
                    "ratio": blocked / single,
                }
            )
    return rows


def _offload_model(device, quick: bool):
    """A Llama with non-reentrant activation checkpointing: (model, input ids, dtype)."""
    import transformers

    small = quick or device.type == "cpu"
    config = transformers.LlamaConfig(
        vocab_size=512 if small else 32000,
        hidden_size=64 if small else 2048,
        intermediate_size=128 if small else 5632,
        num_hidden_layers=4 if small else 16,
        num_attention_heads=4 if small else 16,
        num_key_value_heads=2 if small else 4,
        max_position_embeddings=16384,
        attn_implementation="sdpa",
    )
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seq = 256 if small else 16384
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    return model, ids, dtype


def _step_with_peak(model, ids, device, forward_context=None):
    """(loss, gradients, peak bytes above the start or None on CPU, seconds) of one fwd+bwd; the
    forward runs inside ``forward_context`` (e.g. the activation offload) when given."""
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    with forward_context if forward_context is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    _timing.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return loss.detach().float().item(), [p.grad.detach().clone() for p in model.parameters()], peak, seconds


def _max_grad_diff(grads, others) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in zip(grads, others))


def activation_offload_check(device, quick: bool) -> dict:
    """Loss, gradients, peak memory and time of one fwd+bwd with and without activation offload."""
    from hybridsp import offload_activations

    model, ids, dtype = _offload_model(device, quick)
    offload = offload_activations(model)

    def step(use_offload: bool):
        return _step_with_peak(model, ids, device, offload if use_offload else contextlib.nullcontext())

    rows = {}
    for name, use in (("checkpointing", False), ("offload", True), ("checkpointing ", False), ("offload ", True)):
        rows.setdefault(name.strip(), []).append(step(use))  # interleaved, twice each (the first warms up)
    plain, offloaded = rows["checkpointing"][-1], rows["offload"][-1]
    grad_diff = _max_grad_diff(plain[1], offloaded[1])
    noise = _max_grad_diff(plain[1], rows["checkpointing"][0][1])  # CUDA's backward kernels are not deterministic
    stats, layers = dict(vars(offload.stats)), len(offload.layers)
    saved = None if plain[2] is None else plain[2] - offloaded[2]
    offload.remove()
    # On CUDA the peak should drop by about what went to host, less the copies in flight (2 layer inputs)
    expected = stats["offloaded_bytes"] * (stats["offloaded_tensors"] - 2) / max(1, stats["offloaded_tensors"])
    return {
        "device": str(device),
        "dtype": str(dtype),
        "seq_len": ids.shape[1],
        "layers": layers,
        "loss": [plain[0], offloaded[0]],
        "max_grad_diff": grad_diff,
        "stats": stats,
        "peak_bytes": [plain[2], offloaded[2]],
        "peak_saved_bytes": saved,
        "seconds": [plain[3], offloaded[3]],
        "run_to_run_grad_diff": noise,
        "ok": plain[0] == offloaded[0]
        and grad_diff <= 2 * noise
        and stats["offloaded_tensors"] == layers - 1
        and (saved is None or saved >= 0.8 * expected),
    }


def lean_norms_check(device, quick: bool) -> dict:
    """Loss, gradients, peak memory and time of one checkpointed fwd+bwd with HF norms and lean norms."""
    from hybridsp import apply_lean_norms

    model, ids, dtype = _offload_model(device, quick)
    rows = {"hf": [], "lean": []}
    for name in ("hf", "lean", "hf", "lean"):  # interleaved, twice each (the first warms up)
        with apply_lean_norms(model) if name == "lean" else contextlib.nullcontext():
            rows[name].append(_step_with_peak(model, ids, device))
    hf, lean = rows["hf"][-1], rows["lean"][-1]
    grad_rel = max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(lean[1], hf[1])
    )
    tolerance = 2e-6 if dtype == torch.float32 else 2e-2
    return {
        "device": str(device),
        "dtype": str(dtype),
        "seq_len": ids.shape[1],
        "loss": [hf[0], lean[0]],
        "max_grad_rel": grad_rel,
        "peak_bytes": [hf[2], lean[2]],
        "seconds": [hf[3], lean[3]],
        "ok": hf[0] == lean[0] and grad_rel <= tolerance and (hf[2] is None or lean[2] <= hf[2]),
    }


def _markdown(report: dict) -> str:
    lines = [
        f"# GPU check ({report['device']}, {report['date']})",
        "",
        "## Correctness (rel. error vs fp32 reference)",
        "",
        "| backend | dtype | causal | kv heads | out, dq, dk, dv | same-dtype math | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["correctness"]:
        errors = _timing.scientific(r["errors_out_dq_dk_dv"])
        floor = _timing.scientific(r["same_dtype_math"])
        lines.append(
            f"| {r['backend']} | {r['dtype']} | {r['causal']} | {r['kv_heads']} | {errors} | {floor} | {r['ok']} |"
        )
    lines += [
        "",
        "## Ring blocking cost (causal, bf16, fwd+bwd, one process)",
        "",
        "| backend | S | R | one call s | R-way blocks s | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["blocking"]:
        lines.append(
            f"| {r['backend']} | {r['seq_len']} | {r['ring']} | {r['single_s']:.4f} | {r['blocked_s']:.4f} | {r['ratio']:.3f} |"
        )
    if "offload" in report:
        o, mib = report["offload"], lambda v: "-" if v is None else f"{v / 2**20:,.0f}"
        lines += [
            "",
            "## Activation-checkpoint offload (one fwd+bwd, HF Llama, checkpointing on)",
            "",
            "| device | dtype | S | loss (ckpt / offload) | max grad diff (run to run) | offloaded tensors / MiB | "
            "peak MiB (ckpt / offload) | peak saved MiB | seconds (ckpt / offload) | ok |",
            "|---|---|---|---|---|---|---|---|---|---|",
            f"| {o['device']} | {o['dtype']} | {o['seq_len']} | {o['loss'][0]:.6f} / {o['loss'][1]:.6f} | "
            f"{o['max_grad_diff']:.1e} ({o['run_to_run_grad_diff']:.1e}) | {o['stats']['offloaded_tensors']} / {mib(o['stats']['offloaded_bytes'])} | "
            f"{mib(o['peak_bytes'][0])} / {mib(o['peak_bytes'][1])} | {mib(o['peak_saved_bytes'])} | "
            f"{o['seconds'][0]:.3f} / {o['seconds'][1]:.3f} | {o['ok']} |",
        ]
    if "lean_norms" in report:
        n, mib = report["lean_norms"], lambda v: "-" if v is None else f"{v / 2**20:,.0f}"
        lines += [
            "",
            "## Lean norms (one fwd+bwd, HF Llama, checkpointing on)",
            "",
            "| device | dtype | S | loss (HF / lean) | max grad rel. diff | peak MiB (HF / lean) | seconds (HF / lean) | ok |",
            "|---|---|---|---|---|---|---|---|",
            f"| {n['device']} | {n['dtype']} | {n['seq_len']} | {n['loss'][0]:.6f} / {n['loss'][1]:.6f} | "
            f"{n['max_grad_rel']:.1e} | {mib(n['peak_bytes'][0])} / {mib(n['peak_bytes'][1])} | "
            f"{n['seconds'][0]:.3f} / {n['seconds'][1]:.3f} | {n['ok']} |",
        ]
    lines += head_chunks.markdown(report)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=harness.results_dir("gpu_check"), help="folder for gpu_check.{md,json}")
    parser.add_argument("--quick", action="store_true", help="small sizes (for a CPU dry run)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["torch"]
    if device.type == "cuda":
        import importlib.util

        backends = (["flash"] if importlib.util.find_spec("flash_attn") else []) + ["torch"]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "correctness": correctness(device, backends, args.quick or device.type == "cpu"),
        "blocking": ring_blocking_cost(device, backends[0], args.quick or device.type == "cpu"),
        "offload": activation_offload_check(device, args.quick),
        "lean_norms": lean_norms_check(device, args.quick),
        "head_chunk_kernel": head_chunks.kernel_cost(device, backends[0], args.quick or device.type == "cpu"),
        "head_chunk_call": head_chunks.hybrid_call(device, backends[0], args.quick),
    }
    if "flash" in backends:
        try:
            get_kernel("flash").forward(
                *_timing.inputs(1, 16, 2, 2, 64, torch.float32, device)[:3], causal=False, softmax_scale=0.1
            )
            report["flash_fp32"] = "accepted (unexpected)"
        except ValueError as error:
            report["flash_fp32"] = f"refused: {error}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    harness.write_results(str(out / "gpu_check"), _markdown(report), report)
    print(_markdown(report))
    if not all(r["ok"] for r in report["correctness"]):
        raise SystemExit("a backend exceeded twice the same-dtype rounding error")
    if not report["offload"]["ok"]:
        raise SystemExit("activation offload changed the results or did not lower the peak memory")
    if not all(r["ok"] for r in report["head_chunk_call"]):
        raise SystemExit("hybrid_attn_func with head_chunks exceeded twice bf16 rounding of the kernel alone")
    if not report["lean_norms"]["ok"]:
        raise SystemExit("lean norms changed the loss, moved the gradients past rounding or raised the peak memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
