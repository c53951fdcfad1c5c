"""Tensor parallelism for every family of tests/helpers/families.py: each tiny model split ``T = 2`` ways by
:func:`hybridsp.integrations.transformers.tensor_parallel` (and switched and sharded over the sequence where the
switch takes the family) gives the logits, loss and every parameter gradient (the shards gathered back to the
full shape) of the same unmodified model run on one process; the parts that cannot be split exactly are refused
in one ValueError before anything changes."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hybridsp import init_mesh, real_token_mask, shard_batch, sharded_cross_entropy, sharded_load_balancing_loss
from hybridsp.integrations import transformers as hf
from hybridsp.tensor_parallel._model_split import load_sharded_safetensors, tensor_plan
from hybridsp.testing import run_distributed
from tests.helpers.families import build_family, families_where
from tests.helpers.models.generation import prompt, reference_generate
from tests.helpers.models.switched import expected_of, make_batch, sharded
from tests.helpers.references.attention import rel_err

pytestmark = [pytest.mark.integration]

TOLERANCE = 1e-4
BATCH = make_batch(64, (64, 50))  # B = 2, the second row padded
# Tensor-parallel and switched at T2 x U2 (Ulysses splits the H/T heads again).
SWITCHED = tuple(families_where("tensor parallel"))  # the support table's "exact" cells (docs/model-support.md)


def varied(model):
    """``model`` with every constant parameter (zero biases, unit norm weights, as families initialise them) given
    distinct values, so a slice of the wrong features, or a bias added T times, changes the result."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 and bool(param.min() == param.max()):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def assemble(pieces: list[torch.Tensor], dim: int, blocks) -> torch.Tensor:
    """The full tensor from the T ranks' shards (inverse of :func:`hybridsp.tensor_parallel._cut_rule.take_shard`)."""
    if blocks is None:
        return torch.cat(pieces, dim=dim)
    per_rank = [piece.split([b // len(pieces) for b in blocks], dim=dim) for piece in pieces]
    return torch.cat([per_rank[r][b] for b in range(len(blocks)) for r in range(len(pieces))], dim=dim)


def full_gradient(grad: torch.Tensor, name: str, plan, mesh) -> torch.Tensor:
    """A split parameter's gradient gathered over the tensor group to the full shape; a replicated one as is."""
    if name not in plan.split_dims:
        return grad
    pieces = [torch.empty_like(grad) for _ in range(mesh.tensor)]
    dist.all_gather(pieces, grad.contiguous(), group=mesh.tensor_group)
    return assemble(pieces, plan.split_dims[name], plan.split_blocks.get(name))


def family_errors(name: str, mesh, sequence_parallel: bool, switch: bool, overrides: dict) -> dict[str, float]:
    """{what: relative error} of family ``name`` split over ``mesh`` (switched when ``switch``) against its
    unmodified self, plus the check that every split parameter holds exactly 1/T of its bytes."""
    model = varied(build_family(name, **overrides))
    full_sizes = {n: p.numel() for n, p in model.named_parameters()}
    ref_logits, ref_loss, ref_grads = expected_of(model, BATCH)
    model.zero_grad(set_to_none=True)
    hf.tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    handle = hf.apply(model, mesh) if switch else None
    logits, loss, grads, _ = sharded(model, mesh, BATCH)
    plan = tensor_plan(model)
    real = BATCH["attention_mask"].bool()  # [B, S]
    errors = {"logits": rel_err(logits[:, : real.shape[1]][real], ref_logits[real]), "loss": rel_err(loss, ref_loss)}
    for param_name, grad in grads.items():
        errors[f"grad {param_name}"] = rel_err(full_gradient(grad, param_name, plan, mesh), ref_grads[param_name])
    local_sizes = {n: p.numel() for n, p in model.named_parameters()}
    uneven = [n for n in plan.split_dims if local_sizes[n] * mesh.tensor != full_sizes[n]]
    errors["split parameters not 1/T"] = float(len(uneven))
    if not plan.split_dims or any(n not in plan.split_dims for n in ref_grads if n.endswith("o_proj.weight")):
        errors["nothing split"] = 1.0
    if handle is not None:
        handle.undo()
    return errors


def _check(rank, world, cases, sequence_parallel):
    """Every family of every case against its unmodified self; the (family, mesh) pairs compared."""
    failures, compared = [], []
    for names, (tensor, ulysses, ring), switch, *overrides in cases:
        mesh = init_mesh(ulysses=ulysses, ring=ring, tensor=tensor)
        for name in names:
            errors = family_errors(name, mesh, sequence_parallel, switch, *overrides or [{}])
            worst = max(errors, key=errors.get)
            if not errors[worst] <= TOLERANCE:
                failures.append(
                    f"T={tensor} U={ulysses} R={ring} {name} sp={sequence_parallel}: {worst} {errors[worst]:.2e}"
                )
            compared.append((name, (tensor, ulysses, ring)))
    assert not failures, "\n".join(failures)
    return compared


def _check_cases(world, cases, sequence_parallel, timeout):
    """:func:`_check` on ``world`` ranks, which must compare every family of every case on every rank: a case
    without families (or a table without "exact" cells) would otherwise pass having compared nothing."""
    empty = [shape for names, shape, *_ in cases if not names]
    assert not empty, f"cases with no family to compare: {empty}"
    expected = [(name, shape) for names, shape, *_ in cases for name in names]
    for rank, compared in enumerate(run_distributed(_check, world, cases, sequence_parallel, timeout=timeout)):
        assert compared == expected, f"rank {rank} compared {compared}, not {expected}"


def router_loss_errors(name: str, mesh) -> dict[str, float]:
    """{what: relative error} of a split and switched MoE family trained with its router loss
    (``output_router_logits``, coefficient 0.05) against the unmodified model's own loss with labels."""
    model = varied(build_family(name, output_router_logits=True, router_aux_loss_coef=0.05))
    _, ref_loss, ref_grads = expected_of(model, BATCH)
    model.zero_grad(set_to_none=True)
    hf.tensor_parallel(model, mesh, sequence_parallel=True)
    with hf.apply(model, mesh):
        local = shard_batch(BATCH, mesh, pad_token_id=0)
        out = model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            hybridsp_documents=local["documents"],
            use_cache=False,
            output_router_logits=True,
        )
        aux = sharded_load_balancing_loss(
            out.router_logits,
            real_token_mask(BATCH, mesh, local["documents"]),
            mesh,
            num_experts=model.config.num_experts
            if hasattr(model.config, "num_experts")
            else model.config.num_local_experts,
            top_k=model.config.num_experts_per_tok,
        )
        loss = sharded_cross_entropy(out.logits, local["shift_labels"], mesh) + 0.05 * aux
        loss.backward()
    plan, errors = tensor_plan(model), {"loss": rel_err(loss.detach(), ref_loss)}
    for param_name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=mesh.context_group)
        errors[f"grad {param_name}"] = rel_err(full_gradient(grad, param_name, plan, mesh), ref_grads[param_name])
    return errors


def _router_check(rank, world, names):
    mesh = init_mesh(ulysses=2, ring=1, tensor=2)
    failures = []
    for name in names:
        errors = router_loss_errors(name, mesh)
        worst = max(errors, key=errors.get)
        if not errors[worst] <= TOLERANCE:
            failures.append(f"{name}: {worst} {errors[worst]:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_router_loss_under_tensor_parallelism_equals_the_unmodified_model():
    """The router sits inside the tensor region (its gradient summed over the tensor group): the router loss's
    gradient must count once, not T times (Note [tensor parallelism] in hybridsp.losses._router)."""
    run_distributed(_router_check, 4, ["qwen3_moe"], timeout=600)


# (families, (T, U, R), switched): every family tensor-parallel and switched at T2 x U2. The table has no family
# left for tensor parallelism alone or for a ring only (the switch takes them all since it counts heads from the
# model's config), so neither is a case: a case must compare something (_check_cases).
CASES = [(SWITCHED, (2, 2, 1), True)]


@pytest.mark.distributed
def test_every_family_split_two_ways_with_sequence_parallelism_equals_the_unmodified_model():
    _check_cases(4, CASES, True, timeout=600)


@pytest.mark.distributed
@pytest.mark.slow
def test_every_family_split_two_ways_without_sequence_parallelism_and_over_a_ring():
    cases = CASES + [(SWITCHED, (2, 1, 2), True)]
    _check_cases(4, cases, False, timeout=900)


@pytest.mark.distributed
@pytest.mark.slow
def test_three_way_split_with_one_kv_head_per_rank():
    """T = 3 (without sequence parallelism: 64 tokens do not split 3 ways): 6 query heads, 3 K/V heads (one per
    rank), expert widths 3 x 32."""
    shape = dict(num_attention_heads=6, num_key_value_heads=3, moe_intermediate_size=96)
    _check_cases(3, [(("mixtral", "qwen3_moe"), (3, 1, 1), True, shape)], False, timeout=600)


def _generate(rank, world, cases):
    """Greedy ids and logits of ``hf.generate`` on each split and switched family against the model's own."""
    failures = []
    for name, (ulysses, ring) in cases:
        mesh = init_mesh(ulysses=ulysses, ring=ring, tensor=2)
        model = varied(build_family(name)).eval()
        ref_ids, ref_logits = reference_generate(model, prompt(2, 64), max_new_tokens=6)
        hf.tensor_parallel(model, mesh)  # decoding wants sequence_parallel=False
        hf.apply(model, mesh, backend="torch")
        ids, logits = hf.generate(model, prompt(2, 64), mesh=mesh, max_new_tokens=6, output_logits=True)
        if not torch.equal(ids, ref_ids) or rel_err(logits, ref_logits) > TOLERANCE:
            failures.append(f"{name}: ids equal {torch.equal(ids, ref_ids)}, logits {rel_err(logits, ref_logits):.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
@pytest.mark.slow
def test_generate_with_the_new_families_split_two_ways_equals_their_own_generate():
    cases = [("qwen3_moe", (2, 1)), ("mixtral", (2, 1)), ("olmo2", (2, 1)), ("glm4", (2, 1)), ("phi3", (1, 2))]
    run_distributed(_generate, 4, cases, timeout=600)


def _mesh(tensor: int, ulysses: int = 1):
    return SimpleNamespace(tensor=tensor, ulysses=ulysses, tensor_rank=0, tensor_group=None)


REFUSED = {  # family, overrides, tensor degree, the message
    "expert width": (
        "qwen3_moe",
        dict(moe_intermediate_size=33),
        2,
        r"layer 0.mlp.experts' intermediate width 33 is not divisible by tensor=2",
    ),
    "dense width": (
        "deepseek_v3",
        dict(intermediate_size=95),
        2,
        r"layer 0.mlp's intermediate width \(down_proj in_features\) 95 is not divisible by tensor=2",
    ),
    "deepseek expert width": (
        "deepseek_v3",
        dict(moe_intermediate_size=31),
        2,
        r"layer 1.mlp.experts' intermediate width 31 is not divisible",
    ),
    "gpt_oss expert width": (
        "gpt_oss",
        dict(intermediate_size=95),
        2,
        r"experts' intermediate width 95 is not divisible",
    ),
    "MLA heads": ("deepseek_v3", {}, 8, r"4 query heads are not divisible by tensor=8"),
    "K/V heads": ("phi3", {}, 4, r"2 key/value heads are not divisible by tensor=4"),
}


def _centred_q_norm(model):
    """OLMo 2 with its q_norm over the projected width replaced by a layer norm (mean subtracted)."""
    model.model.layers[0].self_attn.q_norm = torch.nn.LayerNorm(64, eps=1e-6)
    return model


REFUSED["a width norm that is not a plain RMS norm"] = (
    "olmo2",
    {},
    2,
    r"layer 0.self_attn.q_norm \(LayerNorm\) normalises over 64 features, neither one head's 16 nor a "
    r"plain RMS norm over the 4 x 16 projected width",
)
CHANGE = {"a width norm that is not a plain RMS norm": _centred_q_norm}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_parts_that_cannot_be_split_exactly_are_refused_before_any_change(case):
    family, overrides, tensor, message = REFUSED[case]
    model = CHANGE.get(case, lambda m: m)(build_family(family, **overrides))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        hf.tensor_parallel(model, _mesh(tensor))
    assert tensor_plan(model) is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


LOADED = ("phi3", "qwen3_moe", "gpt_oss", "olmo2", "deepseek_v3")  # fused blocks, 3-D experts (both layouts), MLA


@pytest.mark.parametrize("family", LOADED)
def test_a_checkpoint_loads_straight_into_each_ranks_shards(family, tmp_path):
    """Built on ``meta``, split, loaded from the saved checkpoint by safetensors slices: every tensor of rank 0
    and rank 1 of T = 2 is its slice of the saved model's (fused blocks, expert axes, interleaved gate/up)."""
    import transformers

    saved = varied(build_family(family))
    saved.save_pretrained(tmp_path)
    full = saved.state_dict()
    for rank in range(2):
        with torch.device("meta"):
            model = type(saved)(transformers.AutoConfig.from_pretrained(tmp_path))
        hf.tensor_parallel(model, SimpleNamespace(tensor=2, ulysses=1, tensor_rank=rank, tensor_group=None))
        load_sharded_safetensors(model, tmp_path)
        plan = tensor_plan(model)
        assert len(plan.split_dims) > 0
        for name, value in model.state_dict().items():
            expected = full[name] if name in full else full["model.embed_tokens.weight"]  # a tied LM head
            assert torch.equal(value, plan.shard(name, expected)), (family, rank, name)


def test_a_checkpoint_with_other_per_expert_names_is_reported_missing(tmp_path):
    """Mixtral saves its experts under their original names (block_sparse_moe.experts.{e}.w1): named, not guessed."""
    saved = build_family("mixtral")
    saved.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = type(saved)(saved.config)
    hf.tensor_parallel(model, SimpleNamespace(tensor=2, ulysses=1, tensor_rank=0, tensor_group=None))
    with pytest.raises(ValueError, match=r"lacks \['model.layers.0.mlp.experts.down_proj'"):
        load_sharded_safetensors(model, tmp_path)
