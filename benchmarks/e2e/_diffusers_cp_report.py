"""The markdown report of e2e.diffusers_cp from its data (``render(data)``)."""

from __future__ import annotations

WHY = """\
diffusers 0.42.1's context parallelism does not run on this CPU-only torch as shipped (`benchmarks/e2e/_diffusers_cpu.py`):
`enable_parallelism` divides by `torch.accelerator.device_count()`, 0 here (modeling_utils.py line 1719,
`ZeroDivisionError`; it is made to answer 1 for that call); its ring needs a log-sum-exp, which the one CPU
backend (`native`) refuses (attention_dispatch.py line 876, "Native attention does not support
return_lse=True"), and every other backend is a CUDA kernel: the `_native_flash` backend's op
`aten::_scaled_dot_product_flash_attention` gets torch's CPU flash kernel (hybridsp's `backend="torch"` kernel)
registered as its CPU kernel, forward and backward, so diffusers' Ulysses and ring code runs unchanged on the
same kernel as hybridsp. `diffusers U2xR1 (native)` is its Ulysses on the `native` backend (SDPA; its backward
recomputes the forward), the one configuration that runs with the device-count fix alone. The model is called
with `return_dict=False`, as diffusers' pipelines call it."""


def _mib(x: float) -> str:
    return f"{x:.1f}"


def _step_table(data: dict, step: str) -> list[str]:
    lines = [
        "| world | method | peak MiB / rank | MiB sent / rank | by kind (rank 0, MiB) | CPU s | wall s | out err | grad err |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world, rows in data["worlds"].items():
        for name, row in rows.items():
            cell, errors = row[step], row["errors"]
            kinds = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(cell["sent_by_kind_rank0"].items())) or "-"
            grad = f"{errors.get('grad', 0.0):.1e}" if step == "train" else "-"
            lines.append(
                f"| {world} | {name} | {_mib(cell['peak_mib'])} | {cell['sent_mib']:.2f} | {kinds} | "
                f"{cell['cpu_s']:.3f} | {cell['wall_s']:.3f} | {errors.get('out', 0.0):.1e} | {grad} |"
            )
    return lines


def _ratio_table(data: dict) -> list[str]:
    lines = [
        "| degrees | train peak | train bytes | train CPU | train wall | sample peak | sample bytes | sample CPU | sample wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tag, ratio in data["ratios"].items():
        cells = [
            f"{ratio.get(f'{step}_{measure}', float('nan')):.3f}"
            for step in ("train", "sample")
            for measure in ("peak_mib", "sent_mib", "cpu_s", "wall_s")
        ]
        lines.append(f"| {tag} | " + " | ".join(cells) + " |")
    return lines


def render(data: dict) -> str:
    shape = data["shape"]
    loads = "; ".join(f"world {w}: {a} before, {b} after" for w, (a, b) in data["loads"].items())
    return "\n".join(
        [
            "# hybridsp's diffusers switch against diffusers' own context parallelism",
            "",
            f"Command: `{data['command']}`; revision {data['revision']}; load (1/5/15 min) {loads}; "
            f"{data['machine']}; {data['software']}.",
            "",
            f"Random `WanTransformer3DModel`, {shape['layers']} layers, {shape['heads']} heads of {shape['head_dim']}, "
            f"fp32, batch 1: {shape['video_tokens']:,} video tokens ({shape['frames']} x {shape['size']} x "
            f"{shape['size']} latent, patch 1 x 2 x 2) and {shape['text']} text tokens. Gloo ranks, one thread each, "
            "each world one process group; every method's copy of the model lives in every rank and the steps are "
            f"interleaved in rotating order, a barrier before each; medians of {data['args']['repeats']} rounds "
            "(CPU: summed over the ranks; wall: the slowest rank). Peak: torch's allocations inside the step, "
            f"max over ranks, median of {data['args']['memory_repeats']} measurements. Bytes: what one rank sends (max over ranks), counted by wrapping torch.distributed and "
            "the functional collectives (all-gathers as (W - 1) x the local part, all-to-alls (W - 1) / W of "
            "the input; hybridsp's own `CommCounter` gives the same attention bytes: "
            f"{data['hybridsp_counter_agrees']}). Errors: max |x - one process| / max |one process| of the output and of the gradients "
            "summed over the context ranks. `one process` runs on rank 0 while the others wait.",
            "",
            WHY,
            "",
            "## hybridsp / diffusers at the same degrees (< 1: hybridsp cheaper)",
            "",
            *_ratio_table(data),
            "",
            "## Training step (forward + backward)",
            "",
            *_step_table(data, "train"),
            "",
            "## Sampling step (one forward, no_grad)",
            "",
            *_step_table(data, "sample"),
            "",
        ]
    )
