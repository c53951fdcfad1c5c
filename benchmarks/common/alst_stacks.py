"""The three stacks of the end-to-end comparison against DeepSpeed's ALST, trained inside one gloo rank each.

Shared by alst.compare (whose ranks, alst._ranks, add a memory cap around :func:`train`) and
tests/benchmarks/test_alst_parity.py (copied here from tests/helpers/alst_stacks.py: benchmarks import
nothing from tests). :func:`train_rank` (``fn(rank, world, run)`` for ``run_distributed``) builds the
same Hugging Face
Llama (:class:`Run`'s sizes; ``seed``; fp32; sdpa), the same DeepSpeed config (:func:`ds_config`:
ZeRO ``stage``, clipping, micro batch 1, a client ``torch.optim.AdamW``) and the same data (window
``k`` of the byte corpus of ``examples/text_data.py`` at step ``k``), and trains ``steps`` steps with

- ``reference``: one process, plain DeepSpeed, no sequence parallelism, the model's own HF loss;
- ``alst``: DeepSpeed's Arctic Long Sequence Training as its tutorial and tests use it
  (``deepspeed.runtime.sequence_parallel.ulysses_sp``): ``UlyssesSPAttentionHF.register_with_transformers``
  (Ulysses over all ranks, sdpa inside), ``deepspeed.initialize(..., mpu=)`` with
  ``"sequence_parallel_size"``, a per-rank DataLoader wrapped in ``UlyssesSPDataLoaderAdapter``, the
  model's ``loss_function`` on ``shift_labels`` and the tutorial's differentiable token-weighted
  all-gather of the per-rank losses. ``features="tiled"``: ``TiledMLP`` on every MLP (the tutorial's
  shard count ``ceil(S_local / h)``, max over ranks) and the tiled loss: ``sequence_tiled_compute``
  (the tutorial's, ``alst_loss="sequence_tiled"``) or ArcticTraining's ``TiledFusedLogitsLoss``
  (``alst_loss="fused_logits"``), shards of ~1 GiB of fp32 logits (ArcticTraining's rule);
- ``hybridsp``: ``hybridsp.integrations.deepspeed.initialize`` at ``ulysses x ring``, ``shard_batch``
  and ``sharded_cross_entropy`` (as ``examples/train.py``); ``features="tiled"``: the fused loss
  (``causal_lm_loss``) and ``apply_tiled_mlp``.

``features="best"`` adds HF activation checkpointing to ``tiled`` on both stacks and, for hybridsp,
``apply_lean_norms`` and ``offload_activations`` (the benchmark passes a host allocator outside its
memory cap), with ``split`` ``apply_split_checkpointing``, with ``rope`` ``apply_lean_rope``, with
``spill_dir`` the offload's disk tier writing there.
ALST's own checkpoint offload cannot run on a CPU accelerator (DeepSpeed's skips CPU tensors).

The data: step ``k`` trains window ``k`` (one sequence of ``seq_len`` tokens). The reference and
hybridsp read it on every rank; ALST's ranks each hold a DataLoader over windows ``r, r + SP, ...``
(rank ``r`` of SP), which the adapter turns into window ``k`` at step ``k`` (its round-robin over the
ranks' samples).

A rank returns its losses, DeepSpeed's gradient norms, the lm_head gradient norm (``head_norms``,
when ``run.head_norm``), per-step wall and CPU seconds, and its memory (peak RSS, VmData growth).
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import ROOT
from benchmarks.common.example import example

STACKS = ("reference", "alst", "hybridsp")
FEATURES = ("plain", "tiled", "best")
ALST_LOSSES = ("sequence_tiled", "fused_logits")
IGNORE = -100
LOGITS_SHARD_BYTES = 2**30  # ArcticTraining: about 1 GiB of fp32 logits per loss shard


@dataclass(frozen=True)
class Run:
    """One training run of one stack (everything a rank needs; picklable)."""

    stack: str = "reference"
    ulysses: int = 1
    ring: int = 1
    seq_len: int = 1024
    steps: int = 2
    stage: int = 3
    features: str = "plain"
    alst_loss: str = "sequence_tiled"
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    layers: int = 4
    vocab: int = 256
    tied: bool = False  # tie lm_head to the embedding (ALST's tiled loss then fails under ZeRO-3: see alst.compare)
    seed: int = 0
    lr: float = 1e-3
    clip: float = 1.0
    head_norm: bool = False
    budget: int | None = None  # alst.compare: bytes of VmData a rank may add (RLIMIT_DATA); None: no cap
    limit_from: str = "build"  # alst.compare: the cap counts from after the engine build or after the imports
    head_chunks: int | str = 1  # hybridsp: the "hybridsp" config section's head_chunks (head groups per attention call)
    split: bool = False  # hybridsp, features="best": apply_split_checkpointing (attention and MLP halves)
    rope: bool = False  # hybridsp, features="best": apply_lean_rope (q and k rotated in place)
    spill_dir: str | None = None  # hybridsp, features="best": the offload's disk tier writes its files here

    @property
    def context(self) -> int:
        return self.ulysses * self.ring

    @property
    def name(self) -> str:
        mesh = "" if self.stack == "reference" else f" U{self.ulysses}xR{self.ring}"
        loss = f" ({self.alst_loss})" if self.stack == "alst" and self.features != "plain" else ""
        chunks = f" G{self.head_chunks}" if self.stack == "hybridsp" and self.head_chunks != 1 else ""
        chunks += "+split" if self.stack == "hybridsp" and self.split else ""
        chunks += "+rope" if self.stack == "hybridsp" and self.rope else ""
        chunks += "+disk" if self.stack == "hybridsp" and self.spill_dir else ""
        return f"{self.stack}{mesh}{chunks} {self.features}{loss}"

    def check(self, world: int) -> None:
        """ValueError before any collective for a run these ranks cannot train."""
        if self.stack not in STACKS or self.features not in FEATURES or self.alst_loss not in ALST_LOSSES:
            raise ValueError(
                f"unknown stack {self.stack!r}, features {self.features!r} or alst_loss "
                f"{self.alst_loss!r}: choose from {STACKS}, {FEATURES}, {ALST_LOSSES}"
            )
        want = 1 if self.stack == "reference" else self.context
        if world != want:
            raise ValueError(f"{self.name} needs {want} ranks (DP = 1), got {world}")
        if self.stack == "alst" and self.ring != 1:
            raise ValueError(f"ALST is Ulysses only: ring must be 1, got {self.ring}")
        if self.seq_len % (2 * self.context):
            raise ValueError(
                f"seq_len {self.seq_len} must be a multiple of 2 x U x R = {2 * self.context} (the zigzag layout's "
                f"chunks); pass seq_len={-(-self.seq_len // (2 * self.context)) * 2 * self.context}"
            )


def reference_of(run: Run) -> Run:
    """The one-process run that ``run`` must equal."""
    return replace(run, stack="reference", ulysses=1, ring=1, features="plain", budget=None)


# --------------------------------------------------------------------------------------------
# model, config, data


def build_model(run: Run):
    """The tiny Llama of ``run`` (examples/train.py's shape rule: I = 8h/3 rounded down to 64), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=run.vocab,
        hidden_size=run.hidden,
        intermediate_size=int(run.hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=run.layers,
        num_attention_heads=run.heads,
        num_key_value_heads=run.kv_heads,
        max_position_embeddings=max(run.seq_len, 2048),
        rope_theta=500000.0,
        tie_word_embeddings=run.tied,
        attn_implementation="sdpa",
    )
    torch.manual_seed(run.seed)
    model = LlamaForCausalLM(config)
    if run.features == "best":
        model.gradient_checkpointing_enable()
    return model


def ds_config(run: Run) -> dict:
    """The DeepSpeed config every stack shares (each adds only its sequence-parallel keys): the ZeRO
    section of the shipped ``ds_configs/cp4.json`` (buckets of 5e7 elements, not DeepSpeed's 5e8
    defaults, whose reserved memory would count against a per-rank cap) at ``run.stage``."""
    import json

    zero = json.loads((ROOT / "ds_configs" / "cp4.json").read_text())["zero_optimization"]
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": run.clip,
        "zero_optimization": {**zero, "stage": run.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def windows(run: Run):
    """examples/text_data.py's windows of the built-in byte corpus (window k: [seq_len] int64)."""
    text_data = example("text_data")

    tokens, _ = text_data.tokenize(text_data.load_corpus(None), None)
    return text_data.TokenWindows(tokens, run.seq_len, run.seed)


def optimizer_for(model, run: Run):
    return torch.optim.AdamW(model.parameters(), lr=run.lr)


def head_grad_norm(engine) -> float:
    """Norm of the lm_head weight's full reduced gradient (tied: the embedding's too); a collective."""
    from deepspeed.utils import safe_get_full_grad

    grad = safe_get_full_grad(engine.module.get_output_embeddings().weight)
    return float(grad.double().norm())


# --------------------------------------------------------------------------------------------
# the stacks: each returns step(k) -> loss (forward + backward; the caller runs engine.step)


def reference_stack(run: Run, host_allocator=None):
    import deepspeed

    from hybridsp.integrations.deepspeed._engine import without_cpu_shm_comm_build

    model = build_model(run)
    with without_cpu_shm_comm_build():
        deepspeed.init_distributed()
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer_for(model, run), config=ds_config(run), model_parameters=model.parameters()
        )
    data = windows(run)

    def step(k: int) -> torch.Tensor:
        tokens = data.batch(k, 1).to(engine.device)  # [1, S]
        loss = engine(input_ids=tokens, labels=tokens, use_cache=False).loss
        engine.backward(loss)
        return loss

    return engine, step


def hybridsp_stack(run: Run, host_allocator=None):
    import hybridsp
    from hybridsp.integrations.deepspeed import initialize
    from hybridsp.integrations.transformers import causal_lm_loss
    from hybridsp.memory._lean_norm import apply_lean_norms
    from hybridsp.memory._tiled_mlp import apply_tiled_mlp

    model = build_model(run)
    section = {"ulysses": run.ulysses, "ring": run.ring, "head_chunks": run.head_chunks}
    config = {**ds_config(run), "hybridsp": section}
    engine, _, mesh, _ = initialize(model, config, optimizer=optimizer_for(model, run))
    if run.features != "plain":
        apply_tiled_mlp(engine.module)
    if run.features == "best":
        apply_lean_norms(engine.module)
        if run.split:
            hybridsp.apply_split_checkpointing(engine.module)
        if run.rope:
            hybridsp.apply_lean_rope(engine.module)
    options = {} if host_allocator is None else {"host_allocator": host_allocator}
    if run.spill_dir:  # the files are unlinked as they are made
        options["spill_dir"] = run.spill_dir
    offload = hybridsp.offload_activations(engine.module, enabled=run.features == "best", **options)
    data = windows(run)

    def step(k: int) -> torch.Tensor:
        tokens = data.batch(k, 1)  # [1, S], the same on every rank
        local = hybridsp.shard_batch({"input_ids": tokens, "labels": tokens}, mesh)  # each [1, S / C]
        local = {key: value.to(engine.device) for key, value in local.items()}
        with offload:
            if run.features == "plain":
                logits = engine(
                    input_ids=local["input_ids"],
                    position_ids=local["position_ids"],
                    hybridsp_documents=local["documents"],
                    use_cache=False,
                ).logits
                loss = hybridsp.sharded_cross_entropy(logits, local["shift_labels"], mesh)
            else:
                loss = causal_lm_loss(engine, local, mesh)
        engine.backward(loss)
        return loss

    return engine, step


def alst_stack(run: Run, host_allocator=None):
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    from hybridsp.integrations.deepspeed._engine import without_cpu_shm_comm_build

    model = build_model(run)
    with without_cpu_shm_comm_build():
        deepspeed.init_distributed()
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model,
            core_attn_implementation="sdpa",
            sequence_parallel_size=run.ulysses,
            micro_batch_size=1,
            seq_length_is_variable=True,
        )
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer_for(model, run),
            mpu=mpu,
            config={**ds_config(run), "sequence_parallel_size": run.ulysses},
            model_parameters=model.parameters(),
        )
    if run.features != "plain":
        tile_mlps_alst(engine.module)
    group, sp, sp_rank = mpu.get_sequence_parallel_group(), run.ulysses, mpu.get_sequence_parallel_rank()
    loader = UlyssesSPDataLoaderAdapter(
        _rank_loader(run, sp_rank, sp), sp_rank=sp_rank, sp_group=group, sp_world_size=sp, device=engine.device
    )
    batches = iter(loader)

    def step(k: int) -> torch.Tensor:
        batch = next(batches)  # input_ids, position_ids, shift_labels: each [1, S / SP], on the host
        batch = {key: value.to(engine.device) for key, value in batch.items()}
        if run.features == "plain":
            logits = engine(**batch, use_cache=False).logits
            local = engine.module.loss_function(
                logits=logits,
                labels=None,
                shift_labels=batch["shift_labels"],
                vocab_size=engine.module.config.vocab_size,
            )
        else:
            local = alst_tiled_loss(engine.module, batch, run.alst_loss)
        loss = weighted_over_ranks(local, batch["shift_labels"], group, sp)
        engine.backward(loss)
        return loss

    return engine, step


def _rank_loader(run: Run, sp_rank: int, sp: int):
    """The DataLoader an SP rank holds: windows sp_rank, sp_rank + SP, ... as HF-style dicts."""
    data = windows(run)
    indices = list(range(sp_rank, run.steps * sp + sp, sp))

    def collate(items):
        tokens = data.batch(items[0], 1)  # [1, S]
        return {"input_ids": tokens, "position_ids": torch.arange(run.seq_len).unsqueeze(0), "labels": tokens}

    return torch.utils.data.DataLoader(indices, batch_size=1, collate_fn=collate)


def weighted_over_ranks(local_loss: torch.Tensor, shift_labels: torch.Tensor, group, sp: int) -> torch.Tensor:
    """ALST's tutorial: the per-rank mean losses all-gathered (differentiably), weighted by each
    rank's counted tokens."""
    import torch.distributed.nn.functional as dist_nn

    losses = dist_nn.all_gather(local_loss, group=group)
    counted = dist_nn.all_gather((shift_labels != IGNORE).view(-1).sum(), group=group)
    total = sum(losses[r] * counted[r] for r in range(sp))
    return total / max(sum(counted), 1)


def _mlp_math(mlp, x):
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def _alst_tiled_mlp_forward(mlp, x):
    """An MLP forward through DeepSpeed's TiledMLP, with the tutorial's shard count: ceil(S_local / h),
    the maximum over all ranks (so that every rank gathers ZeRO-3 weights the same number of times)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]))
    dist.all_reduce(shards, op=dist.ReduceOp.MAX)
    weights = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
    return TiledMLP.apply(_mlp_math, mlp, x, int(shards), weights)


def tile_mlps_alst(model) -> None:
    """Every decoder MLP of ``model`` forwards through :func:`_alst_tiled_mlp_forward` (per instance;
    the tutorial patches ``LlamaMLP.forward`` on the class, which would leak into other runs)."""
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(_alst_tiled_mlp_forward, layer.mlp)


def _loss_sum(model, hidden_states, shift_labels):
    """ArcticTraining's per-shard loss: the shard's mean loss times its counted tokens (a sum)."""
    logits = model.lm_head(hidden_states)
    counted = (shift_labels != IGNORE).sum()
    if counted == 0:
        return (logits.sum() * 0.0).float()
    mean = model.loss_function(
        logits=logits, labels=None, shift_labels=shift_labels, vocab_size=model.config.vocab_size
    )
    return mean * counted


def loss_shards(model, shift_labels: torch.Tensor) -> int:
    """ArcticTraining's rule: shards of about 1 GiB of fp32 logits."""
    return max(1, math.ceil(shift_labels.numel() * model.config.vocab_size * 4 / LOGITS_SHARD_BYTES))


def alst_tiled_loss(model, batch: dict, kind: str) -> torch.Tensor:
    """This rank's mean loss through ALST's tiled loss (``kind``: sequence_tiled or fused_logits)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, sequence_tiled_compute

    labels = batch["shift_labels"]  # [1, S / SP]
    hidden = model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
    ).last_hidden_state  # [1, S / SP, h]
    shards, weights = loss_shards(model, labels), [model.lm_head.weight]
    if kind == "sequence_tiled":
        total = sequence_tiled_compute(
            _loss_sum,
            labels.shape[1],
            shards,
            {"hidden_states": hidden, "shift_labels": labels},
            {"model": model},
            "hidden_states",
            weights,
            output_unshard_dimension=0,
            output_reduction="sum",
        )
    else:
        total = TiledFusedLogitsLoss.apply(_loss_sum, model, hidden, labels, None, shards, weights, "sum")
    return total / max(int((labels != IGNORE).sum()), 1)


BUILDERS = {"reference": reference_stack, "alst": alst_stack, "hybridsp": hybridsp_stack}


# --------------------------------------------------------------------------------------------
# one rank


def memory_status() -> dict[str, int]:
    """Memory fields of /proc/self/status, bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            fields[name] = int(rest.split()[0]) * 1024
    return fields


def train_rank(rank: int, world: int, run: Run) -> dict:
    """Train ``run`` on this rank (see the module docstring); returns its trace."""
    run.check(world)
    return train(run)


def train(run: Run, after_build=None, host_allocator=None) -> dict:
    """The trace of ``run`` on this rank; ``after_build(status)`` is called once the engine is built
    (with /proc/self/status then), ``host_allocator`` goes to hybridsp's activation offload."""
    base = memory_status()
    engine, step = BUILDERS[run.stack](run, host_allocator)
    built = memory_status()
    if after_build is not None:
        after_build(built)
    trace = {"rank": dist.get_rank(), "losses": [], "norms": [], "head_norms": [], "wall": [], "cpu": []}
    for k in range(run.steps):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        loss = step(k)
        if run.head_norm:
            trace["head_norms"].append(head_grad_norm(engine))
        engine.step()
        trace["wall"].append(time.perf_counter() - wall)
        trace["cpu"].append(time.process_time() - cpu)
        trace["losses"].append(float(loss.detach()))
        trace["norms"].append(float(engine.get_global_grad_norm()))
    end = memory_status()
    trace.update(
        peak_rss=end["VmHWM"],
        base_rss=base["VmRSS"],
        built_rss=built["VmRSS"],
        build_data=built["VmData"] - base["VmData"],
        data_growth=end["VmData"] - base["VmData"],
    )
    return trace
