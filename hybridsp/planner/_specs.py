"""What the planner is given: a model's shapes, a cluster, a workload, and one mesh choice.

Every spec is a frozen dataclass validated in ``__post_init__``; a bad number raises
ValueError quoting it. Presets for common accelerators, links and models live at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hybridsp._checks import check_positive
from hybridsp.linear_attention import LinearLayerSpec
from hybridsp.planner._techniques import Techniques

GIB = 2**30
TIB = 2**40


def _require_positive_ints(spec, *names: str) -> None:
    for name in names:
        check_positive(getattr(spec, name), f"{type(spec).__name__}.{name}", integer=True)


def _require_positive_numbers(spec, *names: str) -> None:
    for name in names:
        check_positive(getattr(spec, name), f"{type(spec).__name__}.{name}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder: GQA attention, SwiGLU MLP, RMSNorm, untied LM head by default.

    Hybrid models: ``linear_layers`` of the ``num_layers`` are recurrent (Gated DeltaNet or
    Mamba-2, shapes in ``linear``: :class:`hybridsp.linear_attention.LinearLayerSpec`); the rest
    are attention. MoE: ``num_experts`` experts of ``expert_intermediate_size`` (None: the
    intermediate size), ``experts_per_token`` active per token, plus a shared expert of
    ``shared_expert_intermediate_size`` (0: none) and a router (h x E) in every layer; parameters
    and optimizer states count every expert, activations and FLOPs the active ones.
    ``attention_output_gate``: q_proj also makes a sigmoid gate of the attention output (Qwen3-Next,
    Qwen3.5: q_proj is h x 2HD).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    tied_embeddings: bool = False
    name: str = "custom"
    v_head_dim: int | None = None  # v's head dim when it differs from q/k's (MLA); None: head_dim
    linear_layers: int = 0
    linear: LinearLayerSpec | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    attention_output_gate: bool = False

    def __post_init__(self):
        _require_positive_ints(
            self,
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "vocab_size",
        )
        if self.v_head_dim is not None:
            _require_positive_ints(self, "v_head_dim")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelSpec: query heads num_heads={self.num_heads} must be a multiple of key/value heads "
                f"num_kv_heads={self.num_kv_heads}; give the model's own values (num_attention_heads, "
                f"num_key_value_heads in its config.json)"
            )
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        if not 0 <= self.linear_layers < self.num_layers:
            raise ValueError(
                f"linear_layers ({self.linear_layers}) must be >= 0 and fewer than num_layers ({self.num_layers}): "
                f"at least one attention layer"
            )
        if self.linear_layers and not isinstance(self.linear, LinearLayerSpec):
            raise ValueError(f"{self.linear_layers} linear layers need their shapes: linear=LinearLayerSpec(...)")
        if self.num_experts < 0 or self.shared_expert_intermediate_size < 0:
            raise ValueError("num_experts and shared_expert_intermediate_size must be >= 0")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token ({self.experts_per_token}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.expert_intermediate_size is not None:
            _require_positive_ints(self, "expert_intermediate_size")

    @property
    def value_head_dim(self) -> int:
        """v's (and the attention output's) head dim: ``v_head_dim``, else ``head_dim``."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def attention_layers(self) -> int:
        """Layers with (softmax) attention: ``num_layers - linear_layers``."""
        return self.num_layers - self.linear_layers

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params_per_layer(self) -> int:
        """q and o projections (h x H*D each; q twice with an output gate) plus k and v (h x Hkv*D each)."""
        h, d = self.hidden_size, self.head_dim
        q = 2 if self.attention_output_gate else 1
        return (q + 1) * h * self.num_heads * d + 2 * h * self.num_kv_heads * d

    @property
    def linear_params_per_layer(self) -> int:
        """A recurrent layer: in-projection h x (conv inputs + gates + output gate), the conv, out-projection."""
        spec = self.linear
        if spec is None:
            return 0
        inner = spec.heads * spec.value_dim
        return self.hidden_size * (spec.features + 2 * inner) + spec.conv_channels * spec.conv_kernel

    @property
    def expert_intermediate(self) -> int:
        return self.intermediate_size if self.expert_intermediate_size is None else self.expert_intermediate_size

    @property
    def active_intermediate(self) -> int:
        """Intermediate width one token runs through: I dense; k x I_e + I_shared for MoE."""
        if not self.is_moe:
            return self.intermediate_size
        return self.experts_per_token * self.expert_intermediate + self.shared_expert_intermediate_size

    @property
    def mlp_params_per_layer(self) -> int:
        """gate, up and down projections: 3 x h x I; MoE: every expert, the shared expert and the router."""
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.intermediate_size
        experts = self.num_experts * self.expert_intermediate + self.shared_expert_intermediate_size
        return 3 * h * experts + h * self.num_experts

    @property
    def active_mlp_params_per_layer(self) -> int:
        """The MLP parameters one token multiplies with (MoE: its k experts, the shared one, the router)."""
        if not self.is_moe:
            return self.mlp_params_per_layer
        return 3 * self.hidden_size * self.active_intermediate + self.hidden_size * self.num_experts

    @property
    def layer_params(self) -> int:
        """The largest decoder layer (ZeRO-3's gather unit): mixer + MLP + two RMSNorm weights."""
        mixer = max(self.attention_params_per_layer, self.linear_params_per_layer)
        return mixer + self.mlp_params_per_layer + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        """Everything ZeRO stores: layers, final norm, embedding and (untied) LM head."""
        head = 0 if self.tied_embeddings else self.embedding_params
        mixers = (
            self.attention_layers * self.attention_params_per_layer + self.linear_layers * self.linear_params_per_layer
        )
        per_layer = self.mlp_params_per_layer + 2 * self.hidden_size
        return mixers + self.num_layers * per_layer + self.hidden_size + self.embedding_params + head

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (active experts only): the layers' projections and
        the LM head."""
        mixers = (
            self.attention_layers * self.attention_params_per_layer + self.linear_layers * self.linear_params_per_layer
        )
        return mixers + self.num_layers * self.active_mlp_params_per_layer + self.embedding_params


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes of identical accelerators.

    Bandwidths are bytes/s per accelerator per direction: ``intra_bw`` inside a node (NVLink,
    PCIe), ``inter_bw`` from one accelerator to another node (its share of the NICs).
    ``efficiency`` is the fraction of ``peak_flops`` the kernels achieve; ``reserved_bytes``
    is memory the model never gets (CUDA context, NCCL buffers, allocator fragmentation).
    Offload: ``host_memory_bytes`` per node (shared by its accelerators; 2 TiB by default, a
    DGX H100's), ``host_bw`` bytes/s per accelerator per direction over PCIe, and
    ``host_adam_params_per_s``: parameters per second a node's CPUs update with Adam
    (DeepSpeed's CPU Adam; 1e9 is an assumption, measure your nodes).
    """

    nodes: int
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    peak_flops: float
    memory_bytes: float
    efficiency: float = 0.5
    reserved_bytes: float = 4 * GIB
    name: str = "custom"
    host_memory_bytes: float = 2 * TIB
    host_bw: float = 50e9
    host_adam_params_per_s: float = 1e9

    def __post_init__(self):
        _require_positive_ints(self, "nodes", "gpus_per_node")
        _require_positive_numbers(
            self,
            "intra_bw",
            "inter_bw",
            "peak_flops",
            "memory_bytes",
            "efficiency",
            "host_memory_bytes",
            "host_bw",
            "host_adam_params_per_s",
        )
        if self.efficiency > 1:
            raise ValueError(f"efficiency is a fraction of peak in (0, 1]; got {self.efficiency}")
        if not 0 <= self.reserved_bytes < self.memory_bytes:
            raise ValueError(
                f"reserved memory ({self.reserved_bytes / GIB:.1f} GiB) must be >= 0 and less than the "
                f"accelerator's {self.memory_bytes / GIB:.1f} GiB"
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    @property
    def achieved_flops(self) -> float:
        return self.peak_flops * self.efficiency

    @property
    def host_bytes_per_gpu(self) -> float:
        """Each accelerator's share of its node's host memory (what offload may fill)."""
        return self.host_memory_bytes / self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    """One training (or forward-only) step: ``micro_batch`` sequences of ``seq_len`` tokens per replica.

    ``dtype_bytes`` is the element size of activations, q/k/v and their gradients (2 for bf16).
    ``chunked_loss``: the loss never materialises the full logits (kept for compatibility: the
    same as ``techniques.fused_loss``). ``techniques``: fused loss, tiled MLP, offload
    (:class:`hybridsp.planner._techniques.Techniques`). ``attention_work``: the attention FLOPs as a
    fraction of one unpacked sequence's (packed documents attend only within themselves:
    :func:`hybridsp.planner._packing.attention_work_fraction`; 1 for one document per row).
    """

    seq_len: int
    micro_batch: int = 1
    forward_only: bool = False
    causal: bool = True
    dtype_bytes: int = 2
    chunked_loss: bool = False
    techniques: Techniques = field(default_factory=Techniques)
    attention_work: float = 1.0

    def __post_init__(self):
        _require_positive_ints(self, "seq_len", "micro_batch", "dtype_bytes")
        if not 0 < self.attention_work <= 1:
            raise ValueError(f"Workload.attention_work is a fraction in (0, 1]; got {self.attention_work}")
        if not isinstance(self.techniques, Techniques):
            raise ValueError(f"Workload.techniques must be a Techniques; got {self.techniques!r}")

    @property
    def fused_loss(self) -> bool:
        return self.chunked_loss or self.techniques.fused_loss


@dataclass(frozen=True)
class MeshConfig:
    """One candidate: ``world = dp * ulysses * ring``, a ZeRO stage, activation checkpointing on/off."""

    dp: int
    ulysses: int
    ring: int
    zero_stage: int = 0
    checkpointing: bool = False

    def __post_init__(self):
        _require_positive_ints(self, "dp", "ulysses", "ring")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {self.zero_stage!r}")

    @property
    def context(self) -> int:
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return self.dp * self.context

    def label(self) -> str:
        ckpt = " ckpt" if self.checkpointing else ""
        return f"DP={self.dp} U={self.ulysses} R={self.ring} ZeRO-{self.zero_stage}{ckpt}"


@dataclass(frozen=True)
class GpuPreset:
    """Dense bf16 peak, memory, and per-direction link bandwidths of one accelerator model."""

    peak_flops: float
    memory_bytes: float
    nvlink_bw: float
    pcie_bw: float


GPUS = {
    "a100": GpuPreset(312e12, 80 * GIB, nvlink_bw=300e9, pcie_bw=32e9),  # NVLink 3, PCIe gen4
    "h100": GpuPreset(989e12, 80 * GIB, nvlink_bw=450e9, pcie_bw=64e9),  # SXM, NVLink 4, PCIe gen5
    "h200": GpuPreset(989e12, 141 * GIB, nvlink_bw=450e9, pcie_bw=64e9),
}
INTER_LINKS = {"ib": 50e9, "ethernet": 12.5e9}  # 400 Gb/s NDR per GPU; 100 GbE per GPU
INTRA_LINKS = ("nvlink", "pcie")

MODELS = {
    "llama3-8b": ModelSpec(32, 8, 128, 4096, 14336, 32, 128256, name="llama3-8b"),
    "llama3-70b": ModelSpec(64, 8, 128, 8192, 28672, 80, 128256, name="llama3-70b"),
    "llama3-405b": ModelSpec(128, 8, 128, 16384, 53248, 126, 128256, name="llama3-405b"),
    "llama2-7b": ModelSpec(32, 32, 128, 4096, 11008, 32, 32000, name="llama2-7b"),
    "qwen2.5-7b": ModelSpec(28, 4, 128, 3584, 18944, 28, 152064, name="qwen2.5-7b"),
    # MoE: every expert stored, k active per token (transformers' Qwen3MoeConfig / MixtralConfig of the releases)
    "qwen3-30b-a3b": ModelSpec(
        32,
        4,
        128,
        2048,
        6144,
        48,
        151936,
        name="qwen3-30b-a3b",
        num_experts=128,
        experts_per_token=8,
        expert_intermediate_size=768,
    ),
    "mixtral-8x7b": ModelSpec(
        32, 8, 128, 4096, 14336, 32, 32000, name="mixtral-8x7b", num_experts=8, experts_per_token=2
    ),
    # hybrid: 3 of every 4 layers Gated DeltaNet (16 key heads, 32 value heads, dk = dv = 128, conv 4),
    # attention with an output gate; transformers 5.24's Qwen3_5TextConfig / Qwen3NextConfig defaults
    "qwen3.5-9b": ModelSpec(
        16,
        4,
        256,
        4096,
        12288,
        32,
        248320,
        name="qwen3.5-9b",
        linear_layers=24,
        linear=LinearLayerSpec("delta_rule", 16, 32, 128, 128),
        attention_output_gate=True,
    ),
    "qwen3-next-80b-a3b": ModelSpec(
        16,
        2,
        256,
        2048,
        5632,
        48,
        151936,
        name="qwen3-next-80b-a3b",
        linear_layers=36,
        linear=LinearLayerSpec("delta_rule", 16, 32, 128, 128),
        attention_output_gate=True,
        num_experts=512,
        experts_per_token=10,
        expert_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
}


def preset_cluster(
    gpu: str, nodes: int, gpus_per_node: int, intra: str = "nvlink", inter: str = "ib", **overrides
) -> ClusterSpec:
    """A :class:`ClusterSpec` from preset names; keyword ``overrides`` replace any field."""
    for value, known, what in (
        (gpu, GPUS, "gpu"),
        (intra, INTRA_LINKS, "intra-node link"),
        (inter, INTER_LINKS, "inter-node link"),
    ):
        if value not in known:
            raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(known)}")
    preset = GPUS[gpu]
    cluster = ClusterSpec(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        intra_bw=preset.nvlink_bw if intra == "nvlink" else preset.pcie_bw,
        inter_bw=INTER_LINKS[inter],
        peak_flops=preset.peak_flops,
        memory_bytes=preset.memory_bytes,
        name=f"{nodes}x{gpus_per_node} {gpu} {intra}/{inter}",
        host_bw=preset.pcie_bw,
    )
    return replace(cluster, **overrides) if overrides else cluster
