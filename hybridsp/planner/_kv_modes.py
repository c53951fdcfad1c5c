"""The two K/V transports priced for the planner: time exposed per step and transient memory.

Per layer and pass, with ``R`` ring ranks, one K/V block ``kv`` bytes (a ring slot's whole
block, input dtype) and its dK/dV ``g`` bytes (input dtype), bandwidth ``bw`` of the slowest
ring hop, ``a`` the latency of one synchronisation on that link (``STEP_LATENCY_S``), and
``f`` one ring step's forward compute (``b = 2.5 f`` backward):

``o`` (``CALL_OVERHEAD_S``) is the fixed cost of one block's kernel launch and LSE merge, paid
per ring step by the ring and per chunk by the all-gather.

``ring`` (:mod:`hybridsp.attention._transport.p2p`; lockstep steps, a step lasts as long as its slowest
transfer, and in every step some rank ships a whole block; the dK/dV of step s travel during
step s + 1)::

    forward  = (R - 1) * (max(0, kv/bw + a - f) + o)
    backward = 2 max(0, kv/bw + a - b) + (R - 3) max(0, (kv + g)/bw + a - b)
               + max(0, g/bw + a - b) + g/bw + a + (R - 1) o    (R >= 3; the last dK/dV is exposed)
             = max(0, kv/bw + a - b) + g/bw + a + o              (R = 2)
    memory   = 2 kv (K/V in flight) [+ backward: the visitor's fp32 dK/dV, its send and the
               received one: g * 4/e + 2 g]

``allgather`` (:mod:`hybridsp.attention._transport.allgather`; ``n`` chunks, see ``default_kv_chunks``): a chunk
gathers ``(R - 1) kv / n`` bytes in one collective of latency ``a * ceil(log2 R)`` (tree /
multicast all-gathers), ``G``; its reduce-scatter of dK/dV moves ``(R - 1) g / n``, ``RS``; a
chunk's compute is ``(R - 1) f / n``, the own block's ``f``::

    forward  = max(0, G - f) + (n - 1) * max(0, G - (R - 1) f / n) + n o
    backward = max(0, G - b) + (n - 1) * max(0, G + RS - (R - 1) b / n) + RS + n o
    memory   = 2 (R / n) kv (two gathered chunks) [+ backward: fp32 dK/dV of a chunk, its
               send and receive buffers: (R / n) g (4/e + 2)]

What decides: the ring sends only the rows a receiver reads (3/4 of the all-gather's bytes
for causal zigzag) and holds two blocks; the all-gather has ``n`` synchronisations per pass
instead of ``R - 1``, and few large kernel calls, so it wins where per-step latency is not
hidden: short blocks (short sequences, many ring ranks), slow-latency links, few K/V heads
(GQA) making the transfers small next to their latency. ``kv_mode="auto"`` takes the faster
one that fits the memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridsp._formulas import default_kv_chunks
from hybridsp.planner._specs import MeshConfig, Workload

FP32 = 4
STEP_LATENCY_S = {"intra": 10e-6, "inter": 30e-6}  # one point-to-point step / collective round (assumed)
CALL_OVERHEAD_S = 15e-6  # one block's kernel launch + LSE merge of the fp32 accumulators (assumed)


@dataclass(frozen=True)
class RingTiming:
    """One ring step's compute and transfer (seconds), and the step's total exposed ring time.

    ``backward_transfer_s`` is a steady-state backward step (ring: a K/V block and a dK/dV
    block in flight together; all-gather: a chunk's gather and the previous reduce-scatter).
    ``mode`` is the K/V transport.
    """

    link: str
    forward_compute_s: float
    forward_transfer_s: float
    backward_compute_s: float
    backward_transfer_s: float
    exposed_s: float
    mode: str = "ring"

    @property
    def forward_hidden(self) -> bool:
        return self.forward_transfer_s <= self.forward_compute_s

    @property
    def backward_hidden(self) -> bool:
        return self.backward_transfer_s <= self.backward_compute_s


def exposed(transfer: float, compute: float) -> float:
    """What of a transfer does not hide behind the compute it overlaps (seconds)."""
    return max(0.0, transfer - compute)


def p2p_ring_timing(
    r: int,
    kv_x: float,
    grad_x: float,
    latency: float,
    fwd_c: float,
    backward: bool,
    passes: int,
    layers: int,
    link: str,
) -> RingTiming:
    """The ring formulas of the module docstring (``kv_x``, ``grad_x``: bytes / bandwidth)."""
    bwd_c, o = 2.5 * fwd_c, CALL_OVERHEAD_S
    forward = (r - 1) * (exposed(kv_x + latency, fwd_c) + o)
    back = 0.0
    if backward and r == 2:
        back = exposed(kv_x + latency, bwd_c) + grad_x + latency + o
    elif backward:
        back = (
            2 * exposed(kv_x + latency, bwd_c)
            + (r - 3) * exposed(kv_x + grad_x + latency, bwd_c)
            + exposed(grad_x + latency, bwd_c)
            + grad_x
            + latency
            + (r - 1) * o
        )
    bwd_x = (kv_x + grad_x if r > 2 else max(kv_x, grad_x)) + latency
    return RingTiming(
        link, fwd_c, kv_x + latency, bwd_c, bwd_x if backward else 0.0, layers * (passes * forward + back)
    )


def allgather_timing(
    r: int,
    chunks: int,
    kv_x: float,
    grad_x: float,
    latency: float,
    fwd_c: float,
    backward: bool,
    passes: int,
    layers: int,
    link: str,
) -> RingTiming:
    """The all-gather formulas of the module docstring (``kv_x``, ``grad_x``: one block / bandwidth)."""
    rounds = latency * math.ceil(math.log2(r))
    gather, reduce = (r - 1) * kv_x / chunks + rounds, (r - 1) * grad_x / chunks + rounds
    chunk_c, bwd_c = (r - 1) * fwd_c / chunks, 2.5 * fwd_c
    o = chunks * CALL_OVERHEAD_S
    forward = exposed(gather, fwd_c) + (chunks - 1) * exposed(gather, chunk_c) + o
    back = 0.0
    if backward:
        back = exposed(gather, bwd_c) + (chunks - 1) * exposed(gather + reduce, 2.5 * chunk_c) + reduce + o
    return RingTiming(
        link,
        chunk_c,
        gather,
        2.5 * chunk_c,
        gather + reduce if backward else 0.0,
        layers * (passes * forward + back),
        mode="allgather",
    )


def planner_chunks(workload: Workload, config: MeshConfig) -> int:
    """The all-gather chunk count the library would pick for this mesh."""
    return default_kv_chunks(config.ring, workload.seq_len // config.ring)


def kv_workspace_bytes(
    mode: str, kv_block: int, grad_block: int, dtype_bytes: int, ring: int, chunks: int, backward: bool
) -> int:
    """Transient K/V transport memory of one attention call (module docstring)."""
    if ring == 1:
        return 0
    if mode == "allgather":
        gathered = ring / chunks
        return round(2 * gathered * kv_block + (gathered * grad_block * (FP32 / dtype_bytes + 2) if backward else 0))
    return 2 * kv_block + (round(grad_block * FP32 / dtype_bytes) + 2 * grad_block if backward else 0)


def kv_timing(workload: Workload, config: MeshConfig, volume, link: str, bandwidth: float, fwd_c: float) -> RingTiming:
    """The exposed K/V time of ``volume.kv_comm`` for one step of one rank."""
    kv_x, grad_x = volume.kv_block_bytes / bandwidth, volume.grad_block_bytes / bandwidth
    args = (kv_x, grad_x, STEP_LATENCY_S[link], fwd_c, volume.backward, volume.forward_passes, volume.layers, link)
    if volume.kv_comm == "allgather":
        return allgather_timing(config.ring, planner_chunks(workload, config), *args)
    return p2p_ring_timing(config.ring, *args)


def best_of(candidates):
    """The plan to keep among one mesh's K/V modes: the fastest that fits, else the first (ring)."""
    fitting = [plan for plan in candidates if plan.fits]
    return min(fitting, key=lambda plan: plan.step_s) if fitting else candidates[0]
