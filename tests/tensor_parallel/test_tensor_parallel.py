"""Tensor parallelism x hybrid sequence parallelism: a tiny Llama and a GQA Qwen2, split
``T = 2`` ways by :func:`hybridsp.integrations.transformers.tensor_parallel` and sharded over the
sequence, give the logits, loss and gradients of the unmodified model run in one process, with and
without sequence parallelism inside the tensor group; each rank holds ~1/T of the layer weights."""

import pytest
import torch
import torch.distributed as dist

from hybridsp import gather_sequence, init_mesh, shard_batch, sharded_cross_entropy
from hybridsp.integrations import transformers as hf
from hybridsp.mesh._hybrid_mesh import MeshShape, check_tensor_heads
from hybridsp.tensor_parallel._model_split import tensor_plan
from hybridsp.testing import run_distributed
from tests.helpers.models.switched import PAD, build, expected_of, make_batch, shard_of
from tests.helpers.references.attention import rel_err

pytestmark = [pytest.mark.integration]  # split transformers models, end to end

TOLERANCE = 1e-4
FAMILIES = {"llama": dict(num_key_value_heads=2), "qwen2": {}}  # both GQA: llama 4/2, qwen2 8/2 (q/k/v bias)
# Replicated parameters inside the tensor region: Qwen3's per-head q_norm / k_norm, and row-parallel
# biases (o_proj / down_proj) that sequence parallelism adds on S/T tokens.
REPLICATED_INSIDE = {
    "qwen3": ("qwen3", {}),
    "llama_biased": ("llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "qwen3_t3": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=3, intermediate_size=96)),
}
BATCH = make_batch(64, (64, 50))


def tp_errors(family, mesh, sequence_parallel, batch=BATCH):
    """{what: relative error} of the tensor- and sequence-parallel run against the reference."""
    base, overrides = REPLICATED_INSIDE.get(family, (family, FAMILIES.get(family)))
    model = build(base, **overrides)
    full_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    ref_logits, ref_loss, ref_grads = expected_of(model, batch)
    model.zero_grad(set_to_none=True)
    hf.tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    hf.apply(model, mesh, backend="torch")
    local = shard_batch(batch, mesh, pad_token_id=PAD)
    out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh)
    loss.backward()
    split = tensor_plan(model).split_dims
    errors = {"loss": rel_err(loss.detach(), ref_loss)}
    logits = gather_sequence(out.logits.detach(), mesh)[:, : batch["input_ids"].shape[1]]
    real = batch["attention_mask"].bool()
    errors["logits"] = rel_err(logits[real], ref_logits[real])
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=mesh.context_group)  # each context rank holds its tokens' share
        errors[f"grad {name}"] = rel_err(grad, shard_of(ref_grads[name], split.get(name), mesh))
    local_bytes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    sharded = (sum(local_bytes[n] for n in split), sum(full_bytes[n] for n in split))
    return errors, sharded, (sum(local_bytes.values()), sum(full_bytes.values())), model


def _uneven_is_refused(model, mesh):
    """Sequence parallelism with 3 tokens per context rank and T = 2: one ValueError on every rank, raised
    before the first collective of the forward."""
    ids = torch.randint(1, 128, (1, 3))  # [1, 3] this rank's tokens
    positions = torch.arange(3)[None] + 3 * mesh.context_rank  # [1, 3]
    with pytest.raises(ValueError, match="splits this rank's 3 tokens 2 ways"):
        model(input_ids=ids, position_ids=positions, use_cache=False)


def _check(rank, world, meshes, families, modes):
    failures, sizes = [], []
    for tensor, ulysses, ring in meshes:
        mesh = init_mesh(ulysses=ulysses, ring=ring, tensor=tensor)
        for family in families:
            for sequence_parallel in modes:
                errors, (shard, whole), (local, full), model = tp_errors(family, mesh, sequence_parallel)
                if sequence_parallel and ring == 1:  # (with a ring, zigzag itself keeps tokens per rank even)
                    _uneven_is_refused(model, mesh)
                if shard * tensor != whole:
                    failures.append(f"{family}: the split linears hold {shard} bytes per rank, not {whole}/{tensor}")
                worst = max(errors, key=errors.get)
                if errors[worst] > TOLERANCE:
                    failures.append(
                        f"T={tensor} U={ulysses} R={ring} {family} sp={sequence_parallel}: {worst} {errors[worst]:.2e}"
                    )
                sizes.append((family, local, full))
    assert not failures, "\n".join(failures)
    return sizes


@pytest.mark.distributed
def test_world_4_t2u2r1_and_t2u1r2_llama_qwen2_equal_the_single_process_model():
    sizes = run_distributed(_check, 4, [(2, 2, 1), (2, 1, 2)], ["llama", "qwen2"], [False, True], timeout=300)
    for family, local, full in sizes[0]:  # embeddings, LM head and norms stay whole; the layers are halved
        assert local < 0.75 * full, (family, local, full)


@pytest.mark.distributed
@pytest.mark.slow
def test_world_8_t2u2r2_llama_qwen2_equal_the_single_process_model():
    run_distributed(_check, 8, [(2, 2, 2)], ["llama", "qwen2"], [False, True], timeout=600)


def test_mesh_tensor_axis_is_innermost_and_other_groups_hold_one_tensor_rank():
    shape = MeshShape(8, 2, 2, tensor=2)
    groups = shape.group_members()
    assert groups["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["ulysses"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["ring"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["data_context"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # ZeRO never spans the tensor group
    assert [shape.coords_of(r) + (shape.tensor_rank_of(r),) for r in (0, 3, 5)] == [
        (0, 0, 0, 0),
        (0, 0, 1, 1),
        (0, 1, 0, 1),
    ]
    assert MeshShape(16, 2, 1, tensor=4).dp == 2
    ring_inner = MeshShape(8, 2, 2, order="ring_inner", tensor=2).group_members()
    assert ring_inner["ring"] == [[0, 2], [1, 3], [4, 6], [5, 7]] and ring_inner["tensor"][0] == [0, 1]
    assert MeshShape(4, 2, 2).group_members()["tensor"] == [[0], [1], [2], [3]]  # T = 1: as before


def test_bad_tensor_degrees_name_the_numbers():
    with pytest.raises(ValueError, match=r"ulysses=2 x ring=1 x tensor=2 = 4 ranks do not divide the world size 6"):
        MeshShape(6, 2, 1, tensor=2)
    with pytest.raises(ValueError, match="tensor degree must be a positive integer"):
        MeshShape(4, 1, 1, tensor=0)
    with pytest.raises(ValueError, match=r"12 query heads are not divisible by tensor=4 x ulysses=2 = 8"):
        check_tensor_heads(12, 4, 4, 2)
    with pytest.raises(ValueError, match=r"2 key/value heads are not divisible by tensor=4"):
        check_tensor_heads(8, 2, 4, 1)
    check_tensor_heads(8, 2, 2, 4)  # H/(T U) = 1 query head per rank; K/V heads repeated by the all-to-all


def test_models_that_cannot_be_split_are_refused_before_any_change():
    from types import SimpleNamespace

    model = build("qwen2")  # 8 query heads, 2 K/V heads, MLP 128
    before = {n: p.clone() for n, p in model.named_parameters()}
    for tensor, ulysses, message in (
        (4, 1, r"2 key/value heads are not divisible by tensor=4"),
        (2, 8, r"8 query heads are not divisible by tensor=2 x ulysses=8 = 16"),
    ):
        mesh = SimpleNamespace(tensor=tensor, ulysses=ulysses, tensor_rank=0, tensor_group=None)
        with pytest.raises(ValueError, match=message):
            hf.tensor_parallel(model, mesh)
    wide = build("llama", intermediate_size=126)  # 4 query and 4 K/V heads
    with pytest.raises(
        ValueError,
        match=r"layer 0.mlp's intermediate width \(down_proj in_features\) 126 is not "
        r"divisible by tensor=4",
    ):
        hf.tensor_parallel(wide, SimpleNamespace(tensor=4, ulysses=1, tensor_rank=0, tensor_group=None))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.distributed
def test_replicated_parameters_inside_the_tensor_region_get_whole_gradients():
    """Qwen3's q_norm / k_norm (T = 2 and T = 3) and Llama's o_proj / down_proj biases under sequence
    parallelism: every parameter's gradient on every tensor rank equals the single-process model's."""
    run_distributed(_check, 2, [(2, 1, 1)], ["qwen3", "llama_biased"], [False, True], timeout=300)
    run_distributed(_check, 3, [(3, 1, 1)], ["qwen3_t3"], [False], timeout=300)
