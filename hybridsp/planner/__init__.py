"""The planner: choose DP x Ulysses x ring degrees and a ZeRO stage for a model on a cluster.

Pure arithmetic (no communication): every (DP, U, R) with ``DP x U x R = nodes x per_node``,
every ZeRO stage 0-3 and activation checkpointing off/on is evaluated for one step of
``B`` sequences of ``S`` tokens per replica, and the fastest plan that fits is recommended.

Notation
    B micro-batch, S sequence length, C = U x R context ranks, N = DP x C = world size,
    T = B S / C tokens per rank, L layers, h hidden size, I intermediate size, V vocabulary,
    H query heads, Hkv K/V heads, D head dim, e element size of activations (2 for bf16),
    Hkv' = Hkv x kv_repeats_for(H, Hkv, U) (GQA heads after the all-to-all's expansion),
    Psi total parameters, P accelerators per node, F = peak FLOP/s x efficiency.

Validity
    H % U == 0; ``layout.check_sequence_length(S, R, U, "zigzag")`` (S % 2R == 0 and
    (S/R) % U == 0); DP x U x R == world.

FLOPs per rank per step (2 FLOPs per multiply-add)
    attention forward, per layer:   4 B S^2 H D c / C,  c = 1/2 causal (zigzag balances it), 1 otherwise
    attention backward:              2.5 x forward (flash-style: recompute QK^T, then dV, dP, dQ, dK)
    dense (all matmuls but attention; N_mm = L (2hHD + 2hHkvD + 3hI) + hV, LM head included):
        forward 2 N_mm T, backward 4 N_mm T (training 6 N_mm T; forward-only 2 N_mm T)
    activation checkpointing recomputes the forward: +1 x attention forward, +2 N_mm T
    one ring step (forward): 4 B (S/R)^2 (H/U) D c

Bytes one rank sends per layer (exact; equal to what ``CommCounter`` records)
    all-to-all tensors: qkv = T (H + 2 Hkv') D e, out = T H D e; (U-1)/U of each leaves the rank.
        forward: qkv + out; backward: dout + dq/dk/dv (the same sizes); +forward again when recomputed.
    ring K/V block: kv = B (S/R) (Hkv'/U) 2 D e; its dK/dV block (accumulated in fp32, rounded once to the
        input dtype before it is sent): g = B (S/R) (Hkv'/U) 2 D e.
        forward (R-1) kv; backward (R-1) kv + R g; +forward again when recomputed.
    ZeRO over N ranks (bf16 ring collectives, X = (N-1)/N 2 Psi): stage 0 gradient all-reduce 2X;
        stages 1-2 gradient reduce-scatter X + parameter all-gather X after the optimizer step;
        stage 3 two parameter all-gathers + reduce-scatter 3X; forward-only X at stage 3, else 0.

Links (rank order ``rank = (dp R + r) U + u``, Ulysses innermost; node = rank // P)
    all-to-all: 1/U of each tensor goes to each peer; peers on the same node use intra_bw,
        others inter_bw, in parallel; time = max(same x chunk / intra_bw, other x chunk / inter_bw)
        for the worst rank (it stays inside a node iff every Ulysses group does: U | P).
        Never overlapped: fully exposed.
    ring: the slowest link any hop uses (the ring moves in lockstep). Step i's transfer hides
        behind step i's compute: exposed per layer = (R-1) max(0, kv/bw - f) forward, and
        max(0, kv/bw - 2.5f) + (R-2) max(0, (kv+g)/bw - 2.5f) + max(0, g/bw - 2.5f) + g/bw
        backward (the last dK/dV hop home is always exposed), f = ring-step FLOPs / F.
    ZeRO: inter_bw when nodes > 1, else intra_bw. The gradient reduction overlaps the backward
        compute (stages 0-2), stage 3's traffic the whole step: exposed = max(0, traffic/bw -
        that compute); the all-gather after the step (stages 1-2) is fully exposed.

Memory per rank (every term in :mod:`hybridsp.planner._memory`)
    persistent: ZeRO-partitioned model states (e + e + 12 bytes/param) + DeepSpeed's gradient
        bucket; at the peak of the step: the checkpointed layers' inputs (on the device, or in
        host memory with activation offload) + the largest of three phases (the loss; an MLP
        backward; an attention backward with its workspace). Techniques
        (:class:`hybridsp.planner._techniques.Techniques`: fused loss, tiled MLP, activation,
        optimizer and parameter offload) change the terms; host memory per node and PCIe
        bandwidth bound offload (:func:`hybridsp.planner._timing.offload_timing`).
    fits iff the device total <= memory - reserved (default 4 GiB) and this rank's offloaded
        bytes <= its share of the node's host memory (default 2 TiB per node).

Step time and ranking
    step = total FLOPs / F + all-to-all + exposed ring + exposed ZeRO + exposed offload.
    Plans are ranked by seconds per sequence = step / (DP x B). The recommendation is the
    fastest plan that fits; plans within ``tie_tolerance`` (2%) of it count as tied and the
    tie goes to a Ulysses group inside a node, then larger U, then a plan leaving ``headroom``
    (10%) of usable memory free, then the faster of them.
"""

from hybridsp._deprecated import renamed_names
from hybridsp.planner._ablation import AblationRow, ablation, format_ablation
from hybridsp.planner._candidates import CandidatePlan, evaluate, mesh_problems
from hybridsp.planner._costs import CommVolume, Flops, comm_volume, flops_per_rank
from hybridsp.planner._memory import MemoryUse, memory_use
from hybridsp.planner._search import (
    LongestContext,
    PlanResult,
    SearchSpace,
    longest_context,
    plan,
    plan_degrees,
    recommend,
)
from hybridsp.planner._specs import (
    GPUS,
    INTER_LINKS,
    MODELS,
    ClusterSpec,
    MeshConfig,
    ModelSpec,
    Workload,
    preset_cluster,
)
from hybridsp.planner._techniques import ABLATION_ORDER, Techniques
from hybridsp.planner._timing import Timing, Topology, mesh_topology, step_timing

__all__ = [
    "ABLATION_ORDER",
    "AblationRow",
    "Techniques",
    "ablation",
    "format_ablation",
    "GPUS",
    "INTER_LINKS",
    "MODELS",
    "ClusterSpec",
    "CommVolume",
    "Flops",
    "LongestContext",
    "MemoryUse",
    "MeshConfig",
    "ModelSpec",
    "CandidatePlan",
    "PlanResult",
    "SearchSpace",
    "Timing",
    "Topology",
    "Workload",
    "comm_volume",
    "evaluate",
    "flops_per_rank",
    "longest_context",
    "memory_use",
    "mesh_problems",
    "mesh_topology",
    "plan",
    "plan_degrees",
    "preset_cluster",
    "recommend",
    "step_timing",
]

__getattr__ = renamed_names(__name__, {"Plan": ("CandidatePlan", CandidatePlan)})
