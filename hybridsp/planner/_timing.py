"""Which link each transfer travels on, and how long one step takes.

The rank order is :class:`hybridsp.mesh._hybrid_mesh.MeshShape`'s (Ulysses innermost by default); node
``n`` holds global ranks ``[n * P, (n + 1) * P)`` for ``P`` accelerators per node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridsp._types import MeshOrder
from hybridsp.linear_attention import linear_layer_bytes
from hybridsp.mesh._hybrid_mesh import MeshShape
from hybridsp.planner._costs import (
    CommVolume,
    Flops,
    attention_forward_flops_per_layer,
    comm_volume,
    flops_per_rank,
    local_tokens,
    ring_step_forward_flops,
    zero_bytes,
)
from hybridsp.planner._head_chunks import chunked_exposed, resolved_head_chunks
from hybridsp.planner._kv_modes import RingTiming, kv_timing
from hybridsp.planner._kv_modes import exposed as _exposed  # offload_timing keeps a running total named exposed
from hybridsp.planner._specs import ClusterSpec, MeshConfig, ModelSpec, Workload


@dataclass(frozen=True)
class Topology:
    """Where a mesh's groups sit on the nodes.

    ``ulysses_peers``: the distinct ``(peers on the same node, peers on other nodes)`` a rank
    has inside its Ulysses group; ``ring_hops``: the links ring hops use (``"intra"``,
    ``"inter"``; empty for a ring of one).
    """

    gpus_per_node: int
    ulysses_peers: tuple[tuple[int, int], ...]
    ring_hops: frozenset[str]

    @property
    def ulysses_crosses_nodes(self) -> bool:
        return any(other > 0 for _, other in self.ulysses_peers)

    @property
    def ring_crosses_nodes(self) -> bool:
        return "inter" in self.ring_hops


def mesh_topology(config: MeshConfig, gpus_per_node: int, order: MeshOrder = "ulysses_inner") -> Topology:
    """Place the mesh's Ulysses and ring groups on nodes of ``gpus_per_node`` ranks."""
    groups = MeshShape(config.world_size, config.ulysses, config.ring, order).group_members()
    peers = set()
    for members in groups["ulysses"]:
        nodes = [rank // gpus_per_node for rank in members]
        for node in set(nodes):
            same = nodes.count(node) - 1
            peers.add((same, len(members) - 1 - same))
    hops: set[str] = set()
    for members in groups["ring"]:  # sorted global ranks are in ring order for both rank orders
        if len(members) > 1:
            nodes = [rank // gpus_per_node for rank in members]
            hops.update("intra" if a == b else "inter" for a, b in zip(nodes, nodes[1:] + nodes[:1]))
    return Topology(gpus_per_node, tuple(sorted(peers)), frozenset(hops))


@dataclass(frozen=True)
class Timing:
    """Modelled seconds of one step on one rank."""

    compute_s: float
    all_to_all_s: float
    ring: RingTiming | None
    zero_comm_s: float
    zero_exposed_s: float
    offload_s: float = 0.0  # exposed host <-> device copies and the CPU optimizer step
    host_traffic_bytes: int = 0  # bytes one rank moves over PCIe per step (both directions)

    @property
    def ring_exposed_s(self) -> float:
        return self.ring.exposed_s if self.ring is not None else 0.0

    @property
    def exposed_comm_s(self) -> float:
        return self.all_to_all_s + self.ring_exposed_s + self.zero_exposed_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.offload_s


def _all_to_all_op_seconds(tensor_bytes: int, ulysses: int, topology: Topology, cluster: ClusterSpec) -> float:
    """One all-to-all of a ``tensor_bytes`` tensor: 1/U of it to each peer, links in parallel,
    the slowest rank decides."""
    chunk = tensor_bytes / ulysses
    return max(
        max(same * chunk / cluster.intra_bw, other * chunk / cluster.inter_bw) for same, other in topology.ulysses_peers
    )


def all_to_all_seconds(
    volume: CommVolume, topology: Topology, cluster: ClusterSpec, chunks: int = 1, attention_s: float = 0.0
) -> float:
    """All all-to-alls of the step: fully exposed at G = 1; head-chunked, each group's overlaps the
    previous group's attention compute (``attention_s``: one layer's attention forward, seconds;
    backward 2.5x; :func:`hybridsp.planner._head_chunks.chunked_exposed`)."""
    if volume.ulysses == 1:
        return 0.0
    per_pass = sum(
        _all_to_all_op_seconds(size, volume.ulysses, topology, cluster) for size in (volume.qkv_bytes, volume.out_bytes)
    )
    forward = volume.forward_passes * chunked_exposed(per_pass, attention_s, chunks)
    backward = chunked_exposed(per_pass, 2.5 * attention_s, chunks) if volume.backward else 0.0
    return volume.layers * (forward + backward)


def linear_comm_seconds(
    model: ModelSpec, workload: Workload, config: MeshConfig, topology: Topology, cluster: ClusterSpec
) -> float:
    """The recurrent layers' communication, exposed: the all-to-all of their inputs and outputs
    (U > 1) and the ring's state pairs and conv halos (R > 1; all-gathers on the ring's slowest
    link), per pass (:func:`hybridsp.linear_attention.linear_layer_bytes`; backward the same again)."""
    if model.linear is None or not model.linear_layers or config.context == 1:
        return 0.0
    sent = linear_layer_bytes(
        model.linear,
        workload.micro_batch,
        workload.seq_len,
        config.ulysses,
        config.ring,
        element_bytes=workload.dtype_bytes,
    )
    u = config.ulysses
    a2a = _all_to_all_op_seconds(sent["ulysses"] * u // (u - 1), u, topology, cluster) if u > 1 else 0.0
    ring = 0.0
    if config.ring > 1:
        slowest = min({"intra": cluster.intra_bw, "inter": cluster.inter_bw}[hop] for hop in topology.ring_hops)
        ring = (sent["ring_states"] + sent["ring_halos"]) / slowest
    passes = (2 if config.checkpointing else 1) + (0 if workload.forward_only else 1)
    return model.linear_layers * passes * (a2a + ring)


def ring_timing(
    model: ModelSpec,
    workload: Workload,
    config: MeshConfig,
    volume: CommVolume,
    topology: Topology,
    cluster: ClusterSpec,
) -> RingTiming | None:
    """Overlap of the K/V transport (``volume.kv_comm``) with the ring's compute; ``None`` for a
    ring of one. Formulas: :mod:`hybridsp.planner._kv_modes`. Head-chunked: G rings of blocks / G
    and compute / G (:mod:`hybridsp.planner._head_chunks`).

    The ring moves in lockstep, so a step's transfer runs at the slowest hop's bandwidth.
    """
    if config.ring == 1:
        return None
    link = "inter" if topology.ring_crosses_nodes else "intra"
    bandwidth = min({"intra": cluster.intra_bw, "inter": cluster.inter_bw}[hop] for hop in topology.ring_hops)
    fwd_c = ring_step_forward_flops(model, workload, config) / cluster.achieved_flops
    chunks = resolved_head_chunks(model, workload, config)
    if chunks == 1:
        return kv_timing(workload, config, volume, link, bandwidth, fwd_c)
    group = replace(
        volume, kv_block_bytes=volume.kv_block_bytes // chunks, grad_block_bytes=volume.grad_block_bytes // chunks
    )
    one = kv_timing(workload, config, group, link, bandwidth, fwd_c / chunks)
    return replace(one, exposed_s=chunks * one.exposed_s)


def offload_timing(
    model: ModelSpec, workload: Workload, config: MeshConfig, cluster: ClusterSpec, flops: Flops
) -> tuple[float, int]:
    """(exposed seconds, PCIe bytes) of one step's offload traffic for one rank.

    Activation offload: each offloaded layer input (T h e) goes to host while the next layer's
    forward runs and comes back while the layer above runs its recompute + backward; what a
    copy takes beyond that layer's compute is exposed. Optimizer offload (ZeRO >= 1): the
    gradient partition down and the updated parameter partition up (e Psi / N each), then the
    CPU Adam step over Psi / N parameters at the node's ``host_adam_params_per_s`` shared by
    its accelerators: all exposed (it runs after the backward). Parameter offload (ZeRO-3):
    the partition comes up once per pass (forward, recompute, backward), hidden behind the
    step's compute up to its length.
    """
    tech, e, psi = workload.techniques, workload.dtype_bytes, model.total_params
    if workload.forward_only:
        passes = 1
    else:
        passes = 3 if config.checkpointing else 2
    exposed, traffic = 0.0, 0
    if tech.activation_offload and config.checkpointing and not workload.forward_only:
        one = local_tokens(workload, config) * model.hidden_size * e
        offloaded = model.num_layers - min(model.num_layers, tech.keep_last)
        copy = one / cluster.host_bw
        forward = flops.forward / model.num_layers / cluster.achieved_flops
        backward = (flops.total - flops.forward) / model.num_layers / cluster.achieved_flops
        exposed += offloaded * (_exposed(copy, forward) + _exposed(copy, backward))
        traffic += 2 * offloaded * one
    shard = -(-psi // config.world_size)
    if tech.optimizer_offload and config.zero_stage >= 1 and not workload.forward_only:
        exposed += 2 * e * shard / cluster.host_bw + shard / (cluster.host_adam_params_per_s / cluster.gpus_per_node)
        traffic += 2 * e * shard
    if tech.param_offload and config.zero_stage == 3:
        exposed += _exposed(passes * e * shard / cluster.host_bw, flops.total / cluster.achieved_flops)
        traffic += passes * e * shard
    return exposed, traffic


def step_timing(
    model: ModelSpec,
    workload: Workload,
    config: MeshConfig,
    topology: Topology,
    cluster: ClusterSpec,
    flops: Flops | None = None,
) -> Timing:
    """Compute / efficiency + all-to-alls + exposed ring + exposed ZeRO traffic.

    ZeRO traffic travels on the inter-node link when the world spans nodes; its overlapped part
    hides behind the backward compute (stages 0-2) or the whole step (stage 3; forward-only:
    the forward), its after-the-step part (stages 1-2) is exposed.
    """
    flops = flops or flops_per_rank(model, workload, config)
    volume = comm_volume(model, workload, config)
    compute = flops.total / cluster.achieved_flops
    forward = flops.forward / cluster.achieved_flops
    zero_link = cluster.inter_bw if cluster.nodes > 1 else cluster.intra_bw
    overlapped, after_step = (size / zero_link for size in zero_bytes(model, workload, config))
    window = compute if config.zero_stage == 3 or workload.forward_only else compute - forward
    offload_s, host_traffic = offload_timing(model, workload, config, cluster, flops)
    chunks = resolved_head_chunks(model, workload, config)
    attention_s = attention_forward_flops_per_layer(model, workload, config.context) / cluster.achieved_flops
    return Timing(
        compute_s=compute,
        all_to_all_s=all_to_all_seconds(volume, topology, cluster, chunks, attention_s)
        + linear_comm_seconds(model, workload, config, topology, cluster),
        ring=ring_timing(model, workload, config, volume, topology, cluster),
        zero_comm_s=overlapped + after_step,
        zero_exposed_s=_exposed(overlapped, window) + after_step,
        offload_s=offload_s,
        host_traffic_bytes=host_traffic,
    )
