"""Token mixers the switch does not implement are refused in one line, before anything changes and before any
collective, and ``check_switchable`` is the same decision as ``apply`` (issue 47).

The models are built on the meta device (the decision reads structure only) or tiny on the CPU, and the meshes
have no process groups: a collective would fail, so a refusal proves it came first.
"""

import pytest
import torch
from torch import nn

from hybridsp.integrations import transformers as hf
from tests.helpers.audit import TINY
from tests.helpers.mesh import mesh_at

pytestmark = pytest.mark.integration


def build(model_type: str, device: str = "meta", **fields):
    """The family's causal LM from its default config with :data:`TINY` (where it has the field) and ``fields``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    default = AutoConfig.for_model(model_type)
    config = AutoConfig.for_model(model_type, **{**{k: v for k, v in TINY.items() if hasattr(default, k)}, **fields})
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def forwards_replaced(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules() if "forward" in m.__dict__ or hasattr(m, "_hybridsp_binding")]


def refusal(model: nn.Module, mesh) -> str:
    """apply's one-line refusal, checked equal to check_switchable's, the model left untouched."""
    with pytest.raises(ValueError) as preflight:
        hf.check_switchable(model, mesh)
    with pytest.raises(ValueError) as applied:
        hf.apply(model, mesh)
    assert str(preflight.value) == str(applied.value)
    assert "\n" not in str(applied.value)
    assert forwards_replaced(model) == []
    implementations = {getattr(c, "_attn_implementation", None) for c in _configs(model)}
    assert "hybridsp" not in implementations
    return str(applied.value)


def _configs(model: nn.Module) -> list:
    config = model.config
    return [config] + [getattr(config, key) for key in getattr(config, "sub_configs", {}) if hasattr(config, key)]


REFUSED = {  # model type, config fields -> the class named in the refusal
    "minimax lightning attention": ("minimax", {}, "MiniMaxLightningAttention"),
    "falcon-h1 mamba, no rms norm": ("falcon_h1", dict(mamba_rms_norm=False), "FalconH1Mixer"),
    "falcon-h1 mamba, rms norm": ("falcon_h1", dict(mamba_rms_norm=True), "FalconH1Mixer"),
    "deepseek-v3.2 sparse-attention indexer": ("deepseek_v32", {}, "DeepseekV32Indexer"),
    "glm-moe-dsa sparse-attention indexer": ("glm_moe_dsa", {}, "GlmMoeDsaIndexer"),
    "olmo-hybrid gated deltanet": ("olmo_hybrid", {}, "OlmoHybridGatedDeltaNet"),
    "doge dynamic-mask attention": ("doge", {}, "DogeAttention"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_unknown_token_mixers_are_refused_by_apply_and_the_preflight(case):
    model_type, fields, klass = REFUSED[case]
    message = refusal(build(model_type, **fields), mesh_at(1, 2))
    assert f"{klass} in layers" in message
    assert "implement a MixerAdapter" in message


def test_a_refused_model_is_refused_on_any_mesh_and_without_one():
    model = build("minimax")
    for mesh in (None, mesh_at(1, 1), mesh_at(2, 2)):
        with pytest.raises(ValueError, match="MiniMaxLightningAttention"):
            hf.check_switchable(model, mesh)


@pytest.mark.parametrize(
    "model_type, fields, mesh, message",
    [
        ("qwen3_5_text", dict(linear_num_key_heads=3, linear_num_value_heads=6), (2, 1), "3 key heads, not divisible"),
        ("nemotron_h", dict(n_groups=2, mamba_num_heads=8), (4, 1), "2 B/C groups, not divisible"),
    ],
)
def test_the_preflight_sees_the_mixers_head_counts(model_type, fields, mesh, message):
    """check_switchable once said yes where apply refused: it now asks the same mixer adapters."""
    model = build(model_type, **fields)
    assert message in refusal(model, mesh_at(*mesh))
    hf.check_switchable(model, mesh_at(1, 2))  # the ring alone takes it


def test_a_model_split_by_transformers_tensor_parallelism_is_refused():
    model = build("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    hf.check_switchable(model, mesh_at(1, 2))
    model._tp_size = 2  # what from_pretrained(..., tp_plan="auto") / distributed_config sets once it split the model
    message = refusal(model, mesh_at(1, 2))
    assert "tensor parallelism (tp_size=2" in message and "tensor_parallel(model, mesh)" in message


class ShortConv(nn.Module):
    """A user's causal depthwise convolution over the sequence: [B, S, D] -> [B, S, D]."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3, groups=width, padding=2)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)  # [B, S, D]


class ShortConvAdapter:
    """A user's MixerAdapter: claims ShortConv by class (the test only checks the switch and its undo)."""

    name = "short conv"

    def __init__(self):
        self.switched: list[nn.Module] = []

    def matches(self, module):
        return type(module) is ShortConv

    def check(self, module, mesh):
        pass

    def switch(self, module, mesh):
        self.switched.append(module)
        return lambda: self.switched.remove(module)


def test_a_user_mixer_is_refused_until_an_adapter_claims_it():
    model = build("llama", device="cpu", num_hidden_layers=2)
    model.model.layers[1].short_conv = ShortConv(64)
    message = refusal(model, mesh_at(1, 2))
    assert "ShortConv in layers 1 (a token mixer by its class" in message
    adapter = ShortConvAdapter()
    mixers = (*hf.default_mixers(), adapter)
    hf.check_switchable(model, mesh_at(1, 2), mixers=mixers)
    with hf.apply(model, mesh_at(1, 1), mixers=mixers):
        assert adapter.switched == [model.model.layers[1].short_conv]
    assert adapter.switched == []


def test_mixers_are_claimed_by_class_not_by_their_attributes():
    """Falcon-H1's mixer has every attribute of Nemotron-H's Mamba-2 mixer and computes something else."""
    from hybridsp.integrations.transformers._token_mixers import claimed_mixers

    nemotron, falcon = build("nemotron_h"), build("falcon_h1")
    assert {type(m).__name__ for m, _ in claimed_mixers(nemotron, hf.default_mixers())} == {"NemotronHMamba2Mixer"}
    assert claimed_mixers(falcon, hf.default_mixers()) == []


def test_the_check_model_command_answers_as_the_switch(tmp_path, capsys):
    from hybridsp.__main__ import main

    build("minimax").config.save_pretrained(tmp_path)
    assert main(["check-model", str(tmp_path), "--ring", "2"]) == 1
    assert "refused. MiniMaxForCausalLM mixes tokens outside attention" in capsys.readouterr().out
    assert main(["check-model", "qwen3_5_text", "--ulysses", "2", "--ring", "2"]) == 0
    out = capsys.readouterr().out
    assert "switchable" in out and "Qwen3_5GatedDeltaNet: 24 layers" in out
