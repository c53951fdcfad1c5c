"""Head chunks, linear-attention and MoE layers, the backward's offload count and the peak breakdown,
against hand-computed formulas on small configs (pure arithmetic)."""

import argparse
import inspect
from dataclasses import replace

import pytest

from hybridsp.__main__ import main
from hybridsp.linear_attention import LinearLayerSpec
from hybridsp.planner import (
    MODELS,
    MeshConfig,
    ModelSpec,
    Techniques,
    Workload,
    longest_context,
    memory_use,
    preset_cluster,
)
from hybridsp.planner._activations import attention_bytes_per_token, checkpoint_bytes, linear_bytes_per_token
from hybridsp.planner._breakdown import peak_breakdown
from hybridsp.planner._cli import add_arguments
from hybridsp.planner._head_chunks import chunked_exposed, head_chunk_choices
from hybridsp.planner._options import techniques_from_args
from hybridsp.planner._phase_terms import attention_workspace_bytes

pytestmark = pytest.mark.fast

SMALL = ModelSpec(8, 4, 16, 128, 256, 4, 1000, name="small")  # H 8, Hkv 4, D 16, h 128


def _workload(seq=4096, **tech):
    return Workload(seq, dtype_bytes=2, techniques=Techniques(kv_mode="ring", **tech))


def test_choices_divide_the_kv_heads_per_ulysses_rank():
    assert head_chunk_choices(SMALL, 1) == (1, 2, 4)
    assert head_chunk_choices(SMALL, 2) == (1, 2)
    assert head_chunk_choices(SMALL, 4) == (1,)


@pytest.mark.parametrize("ulysses, ring", [(1, 4), (2, 2), (4, 1)])
def test_g_shrinks_one_groups_working_set_not_the_results(ulysses, ring):
    """G > 1 preallocates dq/dk/dv of every head (Q + KV, hybridsp.attention._head_chunks) and runs one
    group's working set at a time: its workspace falls as G grows and never goes below the results."""
    config = MeshConfig(1, ulysses, ring)
    tokens, e = 4096 // (ulysses * ring), 2
    results = tokens * (8 * 16 + 4 * 32) * e  # Q + KV (Hkv' = 4: no expansion at U <= 4)
    grouped = [
        attention_workspace_bytes(SMALL, _workload(head_chunks=g), config) for g in head_chunk_choices(SMALL, ulysses)
    ]
    assert all(w > results for w in grouped[1:])
    assert grouped[1:] == sorted(grouped[1:], reverse=True) and len(set(grouped[1:])) == len(grouped[1:])


def test_saved_attention_keeps_the_o_proj_copy_unless_the_output_it_returns_is_kept():
    """The o_proj input is its own tensor unless the call keeps the dense output it returns (U = 1: the
    ring's accumulator, or the head groups' token-major output)."""
    e, hd = 2, 8 * 16
    base = e * (hd + hd + 4 * 32) + 4 * 8
    assert attention_bytes_per_token(SMALL, 1, e, 1, 4) == base
    assert attention_bytes_per_token(SMALL, 1, e, 2, 4) == base  # the groups write a token-major output
    assert attention_bytes_per_token(SMALL, 2, e, 1, 2) == attention_bytes_per_token(SMALL, 2, e, 2, 2) == base + hd * e


def test_overlap_formula():
    assert chunked_exposed(8.0, 100.0, 1) == 8.0
    assert chunked_exposed(8.0, 100.0, 4) == 2.0  # only the first group's waits
    assert chunked_exposed(8.0, 4.0, 4) == pytest.approx(2.0 + 3 * 1.0)


def test_offload_backward_holds_the_restored_and_the_prefetched_input():
    w = Workload(4096, techniques=Techniques(activation_offload=True, keep_last=1, offload_in_flight=2))
    config = MeshConfig(1, 1, 4, checkpointing=True)
    one = 1024 * 128 * 2
    assert checkpoint_bytes(SMALL, w, config, "loss") == (3 * one, 3 * one)
    assert checkpoint_bytes(SMALL, w, config, "backward") == (2 * one, 3 * one)
    cpu = replace(w, techniques=replace(w.techniques, offload_in_flight=0))
    assert checkpoint_bytes(SMALL, cpu, config, "backward")[0] == one


def test_the_disk_tier_leaves_the_host_only_the_writes_in_flight():
    """--spill-activations: the device terms as with the host tier, the host's L - keep_last inputs down to
    the runtime's bound on writes in flight (DiskTier's default, one constant for both)."""
    from hybridsp._formulas import SPILL_WRITES_IN_FLIGHT
    from hybridsp.memory._spill import DiskTier

    config = MeshConfig(1, 1, 4, checkpointing=True)
    one = 1024 * 128 * 2
    deep = replace(SMALL, num_layers=10)
    host = Workload(4096, techniques=Techniques(activation_offload=True))
    disk = replace(host, techniques=replace(host.techniques, spill_activations=True))
    for phase in ("loss", "backward"):
        assert checkpoint_bytes(deep, disk, config, phase)[0] == checkpoint_bytes(deep, host, config, phase)[0]
        assert checkpoint_bytes(deep, host, config, phase)[1] == 9 * one
        assert checkpoint_bytes(deep, disk, config, phase)[1] == SPILL_WRITES_IN_FLIGHT * one == 2 * one
        assert checkpoint_bytes(replace(SMALL, num_layers=2), disk, config, phase)[1] == 1 * one  # under the bound
    assert inspect.signature(DiskTier).parameters["max_writes_in_flight"].default == SPILL_WRITES_IN_FLIGHT
    llama = MODELS["llama3-8b"]
    tech = Techniques(fused_loss=True, tiled_mlp=True, activation_offload=True)
    mesh = MeshConfig(1, 1, 8, zero_stage=3, checkpointing=True)
    plain = memory_use(llama, Workload(1 << 20, techniques=tech), mesh)
    spilled = memory_use(llama, Workload(1 << 20, techniques=replace(tech, spill_activations=True)), mesh)
    assert spilled.total == plain.total and spilled.host < plain.host


def test_the_spill_flag_reaches_the_techniques_and_needs_the_offload():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    both = parser.parse_args(["--model", "llama3-8b", "--offload-activations", "--spill-activations"])
    assert techniques_from_args(both).spill_activations and techniques_from_args(both).activation_offload
    assert not techniques_from_args(parser.parse_args(["--model", "llama3-8b"])).spill_activations
    with pytest.raises(ValueError, match="--spill-activations needs --offload-activations"):
        techniques_from_args(parser.parse_args(["--model", "llama3-8b", "--spill-activations"]))
    with pytest.raises(SystemExit, match="--spill-activations needs --offload-activations"):
        main(["plan", "--model", "llama3-8b", "--seq-len", "1M", "--spill-activations"])


def test_breakdown_sums_to_the_total():
    tech = Techniques(fused_loss=True, tiled_mlp=True, activation_offload=True, lean_norms=True, head_chunks=2)
    for config in (MeshConfig(1, 2, 2, 3, True), MeshConfig(1, 1, 4, 0, False)):
        w = Workload(8192, techniques=tech)
        assert sum(size for _, size in peak_breakdown(SMALL, w, config)) == memory_use(SMALL, w, config).total
        assert all(name != "other" for name, _ in peak_breakdown(SMALL, w, config))


def test_moe_counts_all_experts_in_states_and_active_ones_in_flops():
    moe = replace(SMALL, num_experts=8, experts_per_token=2, expert_intermediate_size=64)
    h = 128
    attention = 2 * h * 128 + 2 * h * 64
    assert moe.mlp_params_per_layer == 3 * h * 8 * 64 + h * 8
    assert moe.total_params == 4 * (attention + 3 * h * 8 * 64 + h * 8 + 2 * h) + h + 2 * 1000 * h
    assert moe.matmul_params == 4 * (attention + 3 * h * 2 * 64 + h * 8) + 1000 * h
    mixtral, llama = MODELS["mixtral-8x7b"], MODELS["llama3-8b"]
    assert mixtral.total_params > 5 * llama.total_params and mixtral.matmul_params < 2 * llama.matmul_params


def test_linear_layers_change_memory_and_time():
    spec = LinearLayerSpec("delta_rule", 2, 4, 16, 16)
    hybrid = replace(SMALL, linear_layers=3, linear=spec)
    e, cc = 2, 2 * 2 * 16 + 4 * 16
    assert linear_bytes_per_token(hybrid, 1, e) == 2 * cc * e + 3 * 64 * e + 4 * (12 + 64 * e)
    w, config = _workload(), MeshConfig(1, 1, 4, checkpointing=True)
    phases = dict(memory_use(hybrid, w, config).phases)
    assert "linear backward" in phases and "linear backward" not in dict(memory_use(SMALL, w, config).phases)


def test_hybrid_and_moe_presets_differ_from_llama():
    cluster = preset_cluster("h100", 1, 8)
    tech = Techniques(fused_loss=True, tiled_mlp=True, activation_offload=True, optimizer_offload=True)
    answers = {
        name: longest_context(MODELS[name], cluster, techniques=tech, granularity=65536).seq_len
        for name in ("llama3-8b", "qwen3.5-9b", "qwen3-30b-a3b")
    }
    assert len(set(answers.values())) == 3, answers


def test_llama3_8b_on_8_h100_plans_past_6m_with_every_technique():
    tech = Techniques(
        fused_loss=True,
        tiled_mlp=True,
        lean_norms=True,
        activation_offload=True,
        optimizer_offload=True,
        head_chunks="auto",
    )
    longest = longest_context(MODELS["llama3-8b"], preset_cluster("h100", 1, 8), techniques=tech, granularity=65536)
    assert longest.seq_len >= 6 * 2**20
    assert longest.result is not None and longest.result.recommended is not None
    assert longest.result.recommended.head_chunks > 1
