"""The DeepSpeed config section: parsing, validation errors, precision, the dict DeepSpeed gets (no processes)."""

import json
import re

import pytest
import torch
from torch import nn

from hybridsp.integrations.deepspeed import (
    HybridConfig,
    HybridMPU,
    auto_precision,
    deepspeed_config,
    load_config,
    resolve_precision,
    scale_gradients,
)
from hybridsp.mesh._hybrid_mesh import HybridMesh, MeshShape
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration

SHIPPED = sorted((ROOT / "ds_configs").glob("*.json")) + sorted((ROOT / "ds_configs" / "trainer").glob("*.json"))
AUTO = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": 0}}


def _raises(call, *fragments):
    with pytest.raises(ValueError) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT / "ds_configs")))
def test_shipped_configs_parse_and_deepspeed_accepts_the_cleaned_dict(path):
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = load_config(path)
    assert raw["bf16"]["enabled"] == "auto"  # hybridsp (or the Trainer) picks the precision for the device
    if path.parent.name == "trainer":  # "auto" values: the HF Trainer fills them before anything else reads them
        from tests.helpers.trainer_configs import filled_by_trainer

        raw = filled_by_trainer(path)
    snapshot = json.loads(json.dumps(raw))
    hybrid = HybridConfig.from_ds_config(raw)
    assert hybrid.context == int(re.match(r"cp(\d+)", path.stem).group(1))
    assert (hybrid.order, hybrid.layout, hybrid.backend) == ("ulysses_inner", "zigzag", "auto")
    cleaned = deepspeed_config(raw, hybrid, precision="fp32")
    assert "hybridsp" not in cleaned and raw == snapshot  # the input is left as it was
    parsed = DeepSpeedConfig(cleaned)
    assert not parsed.bfloat16_config.enabled and not parsed.float16_config.enabled
    assert parsed.gradient_clipping > 0 and parsed.zero_allow_untested_optimizer  # a client torch AdamW works


def test_cp8_is_the_zero3_hybrid_and_its_variants_differ_only_in_the_stage():
    cp8 = load_config(ROOT / "ds_configs" / "cp8.json")
    assert (cp8["hybridsp"]["ulysses"], cp8["hybridsp"]["ring"], cp8["zero_optimization"]["stage"]) == (4, 2, 3)
    for stage in (1, 2):
        variant = load_config(ROOT / "ds_configs" / f"cp8_zero{stage}.json")
        assert variant["zero_optimization"]["stage"] == stage
        assert {k: v for k, v in variant.items() if k != "zero_optimization"} == {
            k: v for k, v in cp8.items() if k != "zero_optimization"
        }


def test_auto_precision_resolves_to_the_device():
    from deepspeed.runtime.config import DeepSpeedConfig

    for precision, expected in {"bf16": (True, False), "fp16": (False, True), "fp32": (False, False)}.items():
        resolved = resolve_precision(AUTO, precision)
        assert (resolved["bf16"]["enabled"], resolved["fp16"]["enabled"]) == expected
        parsed = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **resolved})
        assert (parsed.bfloat16_config.enabled, parsed.float16_config.enabled) == expected
    assert resolve_precision({"bf16": {"enabled": True}}, "fp32")["bf16"]["enabled"] is True  # explicit stays
    assert AUTO["bf16"]["enabled"] == "auto"
    if not torch.cuda.is_available():
        assert auto_precision() == "fp32"
        assert resolve_precision(AUTO)["bf16"]["enabled"] is False


def test_deepspeed_alone_would_silently_train_auto_precision_in_fp32():
    """Why we resolve "auto": DeepSpeed drops every "auto" value (config_utils.py), so bf16 stays off."""
    from deepspeed.runtime.config import DeepSpeedConfig

    parsed = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, **AUTO})
    assert not parsed.bfloat16_config.enabled and not parsed.float16_config.enabled


def test_precision_errors():
    _raises(
        lambda: resolve_precision({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "fp32"),
        "bf16 and fp16 are both enabled",
    )
    _raises(lambda: resolve_precision(AUTO, "fp8"), "unknown precision 'fp8'", "bf16, fp16, fp32")


def test_section_defaults_overrides_and_owned_keys():
    assert HybridConfig.from_ds_config({}).context == 1  # no section: no sequence parallelism
    config = {"hybridsp": {"ulysses": 2, "ring": 2}, "sequence_parallel_size": 4, "data_parallel_size": 2}
    assert HybridConfig.from_ds_config(config, ring=None).ring == 2  # None keeps the config's value
    hybrid = HybridConfig.from_ds_config(config, ulysses=2, ring=2, backend="torch")
    assert (hybrid.context, hybrid.backend, hybrid.mesh_shape(8).dp) == (4, "torch", 2)
    cleaned = deepspeed_config(config, hybrid, precision="fp32")
    owned = {"hybridsp", "sequence_parallel_size", "data_parallel_size"}
    assert not owned & set(cleaned)  # with both sizes DeepSpeed would build its own mesh over the mpu
    assert load_config(config) == config and load_config(config) is not config
    with pytest.raises(TypeError, match="unknown overrides"):
        HybridConfig.from_ds_config(config, rings=2)


def test_validation_errors_quote_the_numbers():
    cfg = HybridConfig.from_ds_config
    _raises(
        lambda: cfg({"hybridsp": {"ulysses": 2, "ring": 2}, "sequence_parallel_size": 8}),
        "sequence_parallel_size=8",
        "ulysses=2 x ring=2 = 4",
    )
    _raises(lambda: cfg({"sequence_parallel_size": 4}), "sequence_parallel_size=4", "= 1 context ranks")
    _raises(
        lambda: cfg({"hybridsp": {"ulysses": 4}, "sequence_parallel_size": 4}, ulysses=2),  # an override too
        "sequence_parallel_size=4",
        "ulysses=2 x ring=1 = 2",
    )
    _raises(
        lambda: cfg({"hybridsp": {"ulysses": 2, "ring": 2}, "data_parallel_size": 4}).mesh_shape(8),
        "data_parallel_size=4",
        "world size 8",
        "= 2 replicas",
    )
    _raises(lambda: HybridConfig(ulysses=4, ring=2).mesh_shape(12), "= 8 context ranks do not divide the world size 12")
    for bad in (0, -1, 2.0, True, "2"):
        _raises(lambda: HybridConfig(ulysses=bad), "ulysses degree must be a positive integer")
    _raises(lambda: HybridConfig(ring=0), "ring degree must be a positive integer")
    _raises(lambda: HybridConfig(order="ring_outer"), "unknown rank order 'ring_outer'")
    _raises(lambda: HybridConfig(layout="striped"), "unknown token layout 'striped'")
    _raises(lambda: HybridConfig(backend="cudnn"), "unknown attention backend 'cudnn'")
    _raises(lambda: HybridConfig(data_parallel_size=0), "data_parallel_size must be a positive integer")
    _raises(lambda: cfg({"hybridsp": {"ulyses": 2}}), "unknown keys ['ulyses']", "ulysses, ring")
    _raises(lambda: cfg({"hybridsp": 4}), "'hybridsp' config section must be an object")


def test_zero3_reduce_scatter_off_is_refused_with_context_parallelism():
    zero3_off = {"zero_optimization": {"stage": 3, "reduce_scatter": False}}
    _raises(
        lambda: deepspeed_config(zero3_off, HybridConfig(ulysses=2, ring=2), precision="fp32"),
        "reduce_scatter=false with 4 context ranks",
        "DP x 4",
    )
    assert deepspeed_config(zero3_off, HybridConfig(), precision="fp32") == zero3_off  # no context ranks: fine
    zero2_off = {"zero_optimization": {"stage": 2, "reduce_scatter": False}}
    assert deepspeed_config(zero2_off, HybridConfig(ulysses=2), precision="fp32") == zero2_off  # ZeRO-2 divides right


def test_mpu_exposes_context_and_data_context_groups_and_no_pure_data_parallel_group():
    groups = {kind: f"<{kind} group>" for kind in ("ulysses", "ring", "context", "data", "data_context")}
    mesh = HybridMesh(MeshShape(8, 2, 2), 5, groups)  # rank 5: dp=1, r=0, u=1
    mpu = HybridMPU(mesh)
    assert hasattr(mpu, "initialize_sequence_parallel")  # DeepSpeed's marker (utils/groups.py)
    assert not hasattr(mpu, "get_data_parallel_group")  # ZeRO-3 would partition over it
    assert mpu.get_sequence_parallel_group() == "<context group>" == mpu.get_model_parallel_group()
    assert mpu.get_sequence_data_parallel_group() == "<data_context group>"
    assert (mpu.get_sequence_parallel_world_size(), mpu.get_model_parallel_world_size()) == (4, 4)
    assert mpu.get_sequence_data_parallel_world_size() == 8
    assert (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()) == (2, 1)


def test_mpu_answers_the_tensor_group_as_model_parallel_with_tensor_2():
    kinds = ("ulysses", "ring", "context", "data", "data_context", "tensor")
    mesh = HybridMesh(MeshShape(8, 2, 1, tensor=2), 5, {kind: f"<{kind} group>" for kind in kinds})  # t=1, u=0, dp=1
    mpu = HybridMPU(mesh)
    assert mpu.get_model_parallel_group() == "<tensor group>"  # Note [tensor-parallel gradient norm]
    assert (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()) == (1, 2)
    assert mpu.get_sequence_parallel_group() == "<context group>"
    assert mpu.get_data_parallel_group() == "<data_context group>"  # ZeRO-3 partitions inside one tensor rank
    assert not hasattr(mpu, "get_slice_parallel_rank")  # DeepSpeed would prefer it to get_model_parallel_rank


def test_scale_gradients_multiplies_and_is_removable():
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    layer(x).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    remove = scale_gradients(layer, 4)
    layer.zero_grad()
    layer(x).sum().backward()
    assert all(torch.equal(p.grad, 4 * e) for p, e in zip(layer.parameters(), expected))
    remove()
    layer.zero_grad()
    layer(x).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(layer.parameters(), expected))


def test_kv_comm_from_the_config_section_and_overrides():
    section = {"hybridsp": {"ulysses": 2, "ring": 2, "kv_comm": "allgather", "kv_chunks": 2}}
    shape = HybridConfig.from_ds_config(section).mesh_shape(8)
    assert (shape.kv_comm, shape.kv_chunks, shape.dp) == ("allgather", 2, 2)
    assert HybridConfig.from_ds_config(section, kv_comm="ring").mesh_shape(4).kv_comm == "ring"
    assert HybridConfig.from_ds_config({"hybridsp": {"ring": 2}}).kv_comm == "ring"  # the default
    _raises(
        lambda: HybridConfig.from_ds_config({"hybridsp": {"kv_comm": "p2p"}}),
        "unknown kv_comm 'p2p'",
        "ring, allgather",
    )


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"hybridsp": {"ulysses": 2, "ring": 2}, "sequence_parallel_size": "4"},
            "sequence_parallel_size must be a positive integer; got '4' (str)",
        ),
        (
            {"hybridsp": {"ulysses": 2}, "data_parallel_size": 2.0},
            "data_parallel_size must be a positive integer; got 2.0",
        ),
        ({"hybridsp": {"ulysses": 2}, "sequence_parallel_size": True}, "got True (bool)"),
    ],
)
def test_config_sizes_must_be_json_numbers(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        HybridConfig.from_ds_config(config)
