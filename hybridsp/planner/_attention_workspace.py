"""The attention call's backward working set on one rank, as hybridsp's code allocates it (the
"attention workspace" of :mod:`hybridsp.planner._memory`).

What is counted: every byte the layer's attention backward allocates from the o_proj input's
gradient to the q/k/v gradients it hands back, at its worst moment, less the saved tensors it
has freed by then (the planner counts those in the layer's saved bytes, as if alive throughout).
Measured term by term on CPU by ``benchmarks/memory/layer_terms.py`` (an HF-shaped call: q/k/v as
views of heads-first tensors, o_proj on the output, the worst rank of a gloo mesh).

Notation: T = B S / C local tokens; a ring slot holds B S / R rows; a head group (G groups,
:mod:`hybridsp.planner._head_chunks`) holds h = H / (U G) query heads and hk = Hkv' / (U G) K/V
heads of it; e the element size, f = 4 / e (the fp32 accumulators). One group's slot tensors:
q = rows h D e, one K/V block kv = rows hk (D + Dv) e, out/dout o = rows h Dv e, its LSE rows h 4.
The call's: Q = T H D e, KV = T Hkv' (D + Dv) e, O = T H Dv e.

Call level (once)
    dout: the o_proj input's gradient O, alive through the call at U = 1 or G > 1 (at U > 1, G = 1
        the all-to-all's backward frees it once it has made the slot dout o); the slot dout o at
        U > 1; less O when the o_proj input is a copy of the call's output
        (:func:`hybridsp.planner._activations.o_proj_input_copied`), freed by o_proj's backward.
    results (G > 1): dq/dk/dv of every head, preallocated, Q + KV.
    the next group's dout in flight (U > 1, G > 1; Note [overlap] in ``hybridsp.attention._head_chunks``):
        its send buffer and its receive buffer, 2 o, alive through the current group's ring.
Group level (one group at a time; ``hybridsp.attention._ring_function.ring_backward``)
    accumulators (R > 1): fp32 dq/dk/dv, f (q + kv) (a ring of one that nothing masks calls the
        kernel once: none).
    the kernel call on a piece of r query rows and k key rows (halves of the slot, below): its
        dq/dk/dv (r q + k kv), the LSE copy it reads (r lse), a copy of dout in its layout
        (r o) when dout is not dense [B, S, H, Dv] (G > 1 at U = 1; h > 1 at U > 1: a heads-first
        slot view), and the aten CPU kernel's per-thread tiles (:func:`kernel_scratch_bytes`).
    the own step: the kernel on the whole slot, with step 1's K/V receive posted and its K/V rows
        copied for sending when they are not contiguous (hk > 1: a view of heads-first storage).
    a visiting step s of ring rank r (``kv_comm="ring"``, :mod:`hybridsp.attention._transport.p2p`):
        the kernel on the piece, the received block and its fp32 dK/dV (1 + f), the next step's
        receive and send copy, the previous step's dK/dV in flight home (input dtype) and the
        buffer for this rank's dK/dV coming back from its previous visitor.
    Causal zigzag (:func:`reads`): a rank reads all of a later slot's block with its second half of
    rows, the first half of an earlier one's with all its rows; not causal: all of everything. The
    worst (rank, step) counts. ``kv_comm="allgather"`` (not measured): the kernel on the whole slot
    and :func:`hybridsp.planner._kv_modes.kv_workspace_bytes` of one group's blocks.

Not the peak, so not counted: the all-to-alls of dout and of dq/dk/dv (U > 1) run before and after the
ring, the latter once the ring's saved slot tensors are freed. Not modelled: GPU kernels' own scratch
(flash-attn's backward keeps an fp32 dq accumulator, f q per group, where the CPU kernel has its
fixed tiles; the planner has no notion of the kernel), the bf16/fp16 CPU kernel's K/V expansion for
GQA (``hybridsp.kernels._torch_fused``, Note [GQA in low precision]), packed documents' and windows'
pieces (the dense causal plan is counted), and gloo freeing a finished collective's buffers late
under load (seen on CPU as 2 to 4 MiB more in some runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridsp._formulas import FP32
from hybridsp.planner._activations import o_proj_input_copied
from hybridsp.planner._costs import expanded_kv_heads, local_tokens
from hybridsp.planner._head_chunks import resolved_head_chunks
from hybridsp.planner._kv_modes import kv_workspace_bytes, planner_chunks
from hybridsp.planner._specs import MeshConfig, ModelSpec, Workload

KV_SPLIT = 512  # the aten CPU flash kernel's key tile
Q_SPLITS = ((768, 256), (192, 64), (0, 32))  # its query tile: 256 rows from 768 query rows, 64 from 192, else 32


@dataclass(frozen=True)
class GroupTensors:
    """One head group's tensors on a ring slot (bytes, input dtype; ``lse`` fp32; ``slot_len``: S / R
    rows of one sequence), and how its views lie: ``dout_copy``: the kernel copies dout into its layout; ``send_copy``: K/V rows are
    copied before they are sent (not contiguous)."""

    slot_len: int
    q: int
    kv: int
    out: int
    lse: int
    accumulate: int
    dout_copy: bool
    send_copy: bool


def group_tensors(model: ModelSpec, workload: Workload, config: MeshConfig) -> GroupTensors:
    """The :class:`GroupTensors` of this plan's head group (module docstring)."""
    u, e = config.ulysses, workload.dtype_bytes
    chunks = resolved_head_chunks(model, workload, config)
    rows = workload.micro_batch * workload.seq_len // config.ring
    heads = model.num_heads // (u * chunks)
    kv_heads = max(1, expanded_kv_heads(model, u) // (u * chunks))
    return GroupTensors(
        slot_len=workload.seq_len // config.ring,
        q=rows * heads * model.head_dim * e,
        kv=rows * kv_heads * (model.head_dim + model.value_head_dim) * e,
        out=rows * heads * model.value_head_dim * e,
        lse=rows * heads * FP32,
        accumulate=max(1, FP32 // e),
        dout_copy=chunks > 1 if u == 1 else heads > 1,
        send_copy=kv_heads > 1,
    )


def kernel_scratch_bytes(rows: int, keys: int) -> int:
    """The aten CPU flash backward's tiles of one thread: fp32 scores and their gradient, q split x kv split."""
    q_split = next(split for least, split in Q_SPLITS if rows >= least)
    return 2 * min(rows, q_split) * min(keys, KV_SPLIT) * FP32


def kernel_bytes(group: GroupTensors, rows: int, keys: int) -> int:
    """One kernel backward on ``rows`` / ``keys`` halves of the slot's query rows / K/V rows (2 = all)."""
    per_half = rows * (group.q + group.lse + (group.out if group.dout_copy else 0)) + keys * group.kv
    scratch = kernel_scratch_bytes(rows * group.slot_len // 2, keys * group.slot_len // 2)
    return per_half // 2 + scratch


def reads(reader: int, owner: int, causal: bool) -> tuple[int, int]:
    """(halves of ``owner``'s K/V block, halves of ``reader``'s query rows) one visit computes on
    (zigzag layout, causal: a later block whole against the second half of the rows, an earlier
    block's first half against all of them; not causal: all of both)."""
    if not causal:
        return 2, 2
    return (2, 1) if owner > reader else (1, 2)


def own_step_bytes(group: GroupTensors, ring: int, rank: int, causal: bool) -> int:
    """The own block's kernel call on rank ``rank``, with step 1's receive and send copy posted."""
    total = kernel_bytes(group, 2, 2)
    if ring == 1:
        return total
    received, _ = reads(rank, (rank - 1) % ring, causal)
    sent, _ = reads((rank + 1) % ring, rank, causal)
    return total + (received + (sent if group.send_copy else 0)) * group.kv // 2


def visiting_step_bytes(group: GroupTensors, ring: int, rank: int, step: int, causal: bool) -> int:
    """Ring step ``step`` (1 .. R-1) of rank ``rank`` (module docstring), in bytes."""
    keys, rows = reads(rank, (rank - step) % ring, causal)
    halves = (1 + group.accumulate) * keys  # the block received and its fp32 dK/dV
    if step + 1 < ring:
        halves += reads(rank, (rank - step - 1) % ring, causal)[0]  # the next block, posted
        if group.send_copy:
            halves += reads((rank + step + 1) % ring, rank, causal)[0]  # own rows for the next reader
    if step >= 2:
        halves += reads(rank, (rank - step + 1) % ring, causal)[0]  # the previous block's dK/dV going home
        halves += reads((rank + step - 1) % ring, rank, causal)[0]  # this rank's dK/dV coming back
    return kernel_bytes(group, rows, keys) + halves * group.kv // 2


def _candidate_ranks(ring: int, step: int) -> set[int]:
    """Ranks where some term of :func:`visiting_step_bytes` changes for this step (its value is
    constant in between: every term compares ``rank`` with ``step`` or ``ring - step`` plus a little)."""
    near = {step + d for d in range(-3, 4)} | {ring - step + d for d in range(-3, 4)} | {0, ring - 1}
    return {rank for rank in near if 0 <= rank < ring}


def worst_step_bytes(group: GroupTensors, ring: int, causal: bool) -> int:
    """The largest own or visiting step over every rank of the ring."""
    worst = max(own_step_bytes(group, ring, rank, causal) for rank in {0, ring - 1})
    for step in range(1, ring):
        for rank in _candidate_ranks(ring, step):
            worst = max(worst, visiting_step_bytes(group, ring, rank, step, causal))
    return worst


def call_bytes(model: ModelSpec, workload: Workload, config: MeshConfig) -> int:
    """The call-level terms (module docstring): dout and its slot copy, the preallocated results and the
    next group's dout in flight (G > 1)."""
    tokens, e, u = local_tokens(workload, config), workload.dtype_bytes, config.ulysses
    chunks = resolved_head_chunks(model, workload, config)
    dout = tokens * model.num_heads * model.value_head_dim * e
    kept = dout if u == 1 or chunks > 1 else 0
    slot = group_tensors(model, workload, config).out if u > 1 else 0
    freed = dout if o_proj_input_copied(model, u, config.ring, chunks) else 0
    results = prefetched = 0
    if chunks > 1:
        kv_heads = expanded_kv_heads(model, u)
        results = tokens * (model.num_heads * model.head_dim + kv_heads * (model.head_dim + model.value_head_dim)) * e
        prefetched = 2 * slot  # the next group's dout: send and receive buffers (none at U = 1)
    return kept + slot - freed + results + prefetched


def backward_workspace_bytes(model: ModelSpec, workload: Workload, config: MeshConfig, kv_mode: str) -> int:
    """The attention backward's working set on one rank (module docstring), K/V moving by ``kv_mode``."""
    group = group_tensors(model, workload, config)
    ring = config.ring
    accumulators = group.accumulate * (group.q + group.kv) if ring > 1 else 0
    if kv_mode == "allgather" and ring > 1:
        blocks = kv_workspace_bytes(
            "allgather", group.kv, group.kv, workload.dtype_bytes, ring, planner_chunks(workload, config), True
        )
        steps = kernel_bytes(group, 2, 2) + blocks
    else:
        steps = worst_step_bytes(group, ring, workload.causal)
    return call_bytes(model, workload, config) + accumulators + steps
