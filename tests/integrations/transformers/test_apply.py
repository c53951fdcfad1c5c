"""The transformers integration: an apply()-ed Llama-family model, sharded over gloo ranks, gives
the logits, loss and gradients of the same unmodified model run on the full sequence in one process."""

import re

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from hybridsp.testing import run_distributed
from tests.helpers.mesh import mesh_at
from tests.helpers.models.switched import build, make_batch, sharded
from tests.helpers.references.attention import rel_err

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
SEQ = 64


BATCHES = {
    "full": make_batch(SEQ, (SEQ, SEQ)),
    "padded": make_batch(61, (61, 40)),  # 61 tokens: shard_batch pads to 64
    "empty_last_shard": make_batch(SEQ, (44, 30)),  # the last chunk of 2R is all padding for R = 2, 4
}


def reference(model, batch):
    """(logits [B, S, V], loss, {name: grad}) of the unmodified model on the full sequence."""
    model.zero_grad(set_to_none=True)
    mask = batch.get("attention_mask")
    labels = batch["labels"] if mask is None else batch["labels"].masked_fill(mask == 0, -100)
    out = model(input_ids=batch["input_ids"], attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def case_errors(model, mesh, batch, expected):
    """{what: relative error} of the sharded run against the reference, logits at real tokens only."""
    logits, loss, grads, valid = sharded(model, mesh, batch)
    ref_logits, ref_loss, ref_grads = expected
    seq = batch["input_ids"].shape[1]
    real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()  # [B, S]
    errors = {"logits": rel_err(logits[:, :seq][real], ref_logits[real]), "loss": rel_err(loss, ref_loss)}
    errors.update({f"grad {n}": rel_err(g, ref_grads[n]) for n, g in grads.items()})
    finite = torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    return errors, finite, valid


def _check_families(rank, world, meshes, families, kv_comm="ring"):
    failures, empty_shards = [], 0
    for ulysses, ring in meshes:
        mesh = init_mesh(ulysses=ulysses, ring=ring, kv_comm=kv_comm)
        for family in families:
            model = build(family)
            expected = {name: reference(model, batch) for name, batch in BATCHES.items()}
            handle = hf.apply(model, mesh, backend="torch")
            for name, batch in BATCHES.items():
                errors, finite, valid = case_errors(model, mesh, batch, expected[name])
                empty_shards += valid == 0
                worst = max(errors, key=errors.get)
                if not finite or errors[worst] > TOLERANCE:
                    failures.append(
                        f"U={ulysses} R={ring} {family} {name}: finite={finite}, {worst} {errors[worst]:.2e}"
                    )
            handle.undo()
            for name, batch in BATCHES.items():  # after undo: the original model, bit for bit
                logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
                if not torch.equal(logits.detach(), expected[name][0]):
                    failures.append(f"U={ulysses} R={ring} {family} {name}: outputs differ after undo")
    assert not failures, "\n".join(failures)
    return empty_shards


@pytest.mark.distributed
def test_world_4_llama_qwen2_mistral_qwen3_equal_the_single_process_model():
    empty = run_distributed(_check_families, 4, [(2, 2)], ["llama", "qwen2", "mistral", "qwen3"], timeout=300)
    assert sum(empty) > 0, "no rank had a shard without valid tokens"


@pytest.mark.distributed
def test_kv_allgather_mesh_through_a_switched_model_equals_the_single_process_model():
    run_distributed(_check_families, 4, [(1, 4)], ["llama", "mistral"], "allgather", timeout=300)


@pytest.mark.distributed
@pytest.mark.slow  # a bigger size of the world-4 check (the same families at U2xR2; the switch matrix: every family)
def test_world_8_llama_and_qwen2_equal_the_single_process_model():
    empty = run_distributed(_check_families, 8, [(4, 2), (2, 4)], ["llama", "qwen2"], timeout=300)
    assert sum(empty) > 0, "no rank had a shard without valid tokens"


# ---- one process: registration, apply/undo, refusals ------------------------------------------


def test_minimum_version_is_stated_and_checked():
    assert Version(transformers.__version__) >= Version(hf.MIN_TRANSFORMERS_VERSION) == Version("4.53.0")
    hf.check_transformers_version()
    with pytest.raises(RuntimeError, match=re.escape("needs transformers>=4.53.0") + ".*found 4.52.4"):
        hf.check_transformers_version("4.52.4")


def test_registration_is_idempotent_and_refuses_a_foreign_entry():
    hf.register()
    hf.register()
    assert transformers.AttentionInterface()[hf.NAME] is hf.hybridsp_attention_forward
    transformers.AttentionInterface.register(hf.NAME, print)
    try:
        with pytest.raises(RuntimeError, match="another function is registered"):
            hf.register()
    finally:
        transformers.AttentionInterface.register(hf.NAME, hf.hybridsp_attention_forward)


def test_single_rank_apply_matches_and_undo_restores_everything():
    model = build("qwen2")
    ids = BATCHES["full"]["input_ids"]
    original = model(input_ids=ids).logits.detach()
    with hf.apply(model, mesh_at(1, 1), backend="reference") as handle:
        assert model.config._attn_implementation == "hybridsp" and handle.active
        assert all(hasattr(layer.self_attn, "_hybridsp_binding") for layer in model.model.layers)
        assert rel_err(model(input_ids=ids, use_cache=False).logits.detach(), original) <= 1e-5
    assert not handle.active and model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "_hybridsp_binding") for m in model.modules())
    assert not model._forward_pre_hooks
    handle.undo()  # a second undo changes nothing
    assert torch.equal(model(input_ids=ids).logits.detach(), original)


def test_undo_restores_an_implementation_chosen_at_load_time():
    hf.register()
    model = build("llama", attn_implementation="hybridsp")
    handle = hf.apply(model, mesh_at(2, 1), backend="torch")
    assert len(model._forward_pre_hooks) == 1
    handle.undo()
    assert model.config._attn_implementation == "hybridsp" and not model._forward_pre_hooks
    with pytest.raises(RuntimeError, match="has no mesh: call hybridsp.integrations.transformers.apply"):
        model(input_ids=BATCHES["full"]["input_ids"])


def test_no_per_shard_mask_is_built_or_accepted():
    assert hf.NAME not in ALL_MASK_ATTENTION_FUNCTIONS  # so transformers' mask builders return None
    model = build("llama")
    ids, mask = BATCHES["padded"]["input_ids"][:, :60], BATCHES["padded"]["attention_mask"][:, :60]
    with hf.apply(model, mesh_at(1, 1)):
        # the attention refuses any mask: a 2D padding mask given to the model never becomes one
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        four_d = torch.zeros(2, 1, SEQ, SEQ)
        with pytest.raises(ValueError, match=re.escape("got an attention mask of shape (2, 1, 64, 64)")):
            model(input_ids=BATCHES["full"]["input_ids"], attention_mask=four_d, use_cache=False)


def _with_a_convolution(model):
    """``model`` with a depthwise causal convolution in its first MLP: a token mixer the switch does not know."""
    model.model.layers[0].mlp.mixer = torch.nn.Conv1d(64, 64, 4, groups=64, padding=3)
    return model


def test_refused_models_raise_and_change_nothing():
    cases = {
        "4 query heads are not divisible by the Ulysses degree 8": (build("llama"), mesh_at(8, 1)),
        "MambaForCausalLM mixes tokens outside attention in modules hybridsp does not implement: MambaMixer": (
            transformers.MambaForCausalLM(
                transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=4)
            ),
            mesh_at(1, 1),
        ),
        "BartForConditionalGeneration is an encoder-decoder model": (
            transformers.BartForConditionalGeneration(
                transformers.BartConfig(
                    vocab_size=64,
                    d_model=32,
                    encoder_layers=1,
                    decoder_layers=1,
                    encoder_attention_heads=2,
                    decoder_attention_heads=2,
                )
            ),
            mesh_at(1, 1),
        ),
        "mixes tokens outside attention in modules hybridsp does not implement: LlamaMLP.mixer in layers 0 (a convolution": (
            _with_a_convolution(build("llama")),
            mesh_at(1, 1),
        ),
    }
    for message, (model, mesh) in cases.items():
        before = model.config._attn_implementation
        with pytest.raises(ValueError, match=re.escape(message)):
            hf.apply(model, mesh)
        assert model.config._attn_implementation == before
        assert not any(hasattr(m, "_hybridsp_binding") for m in model.modules())
    with pytest.raises(TypeError, match="switches a model instance"):
        hf.apply(transformers.LlamaForCausalLM, mesh_at(1, 1))
    model = build("llama")
    handle = hf.apply(model, mesh_at(1, 1))
    with pytest.raises(ValueError, match="already switched"):
        hf.apply(model, mesh_at(1, 1))
    handle.undo()


def test_the_switch_reads_capabilities_not_names():
    model = build("llama")
    model.config.model_type = "my_llama"  # a renamed family: the same attention, accepted by what it calls
    ids = BATCHES["full"]["input_ids"]
    original = model(input_ids=ids).logits.detach()
    with hf.apply(model, mesh_at(1, 1), backend="reference"):
        assert rel_err(model(input_ids=ids, use_cache=False).logits.detach(), original) <= 1e-5
    chunked = build("llama")
    chunked.config.layer_types, chunked.config.attention_chunk_size = ["chunked_attention", "full_attention"], 16
    hf.apply(chunked, mesh_at(2, 2)).undo()  # chunked layers run as documents cut into chunks
    with pytest.raises(
        ValueError,
        match=re.escape("chunked-attention layers (attention_chunk_size=16), which layout='balanced' cannot run"),
    ):
        hf.apply(chunked, mesh_at(1, 2, layout="balanced"))
    bidirectional = build("llama")
    bidirectional.model.layers[1].self_attn.is_causal = False
    with pytest.raises(ValueError, match=re.escape("layer 1 (LlamaAttention) is not causal")):
        hf.apply(bidirectional, mesh_at(1, 1))


def test_calls_that_cannot_be_exact_are_refused():
    ids = BATCHES["full"]["input_ids"]
    model = build("llama", attention_dropout=0.1)
    with hf.apply(model, mesh_at(1, 1)):
        model.eval()
        model(input_ids=ids, use_cache=False)  # no dropout in eval
        model.train()
        with pytest.raises(ValueError, match="attention dropout 0.1 is not supported"):
            model(input_ids=ids, use_cache=False)
    model = build("llama")
    with hf.apply(model, mesh_at(2, 1)):  # C = 2: the pre-hook refuses before anything communicates
        with pytest.raises(ValueError, match="needs position_ids"):
            model(input_ids=ids[:, :32])
        with pytest.raises(ValueError, match="do not pass labels"):
            model(ids[:, :32], None, torch.arange(32)[None], labels=ids[:, :32])
    with hf.apply(model, mesh_at(1, 1)):  # generation: a KV cache that already holds 8 tokens
        query, key = torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 10, 16)
        with pytest.raises(ValueError, match="2 queries but 10 keys per rank: a KV cache with earlier tokens"):
            hf.hybridsp_attention_forward(model.model.layers[0].self_attn, query, key, key, None)


def _autocast_errors(rank, world):
    """Under CPU autocast to bf16 (the HF Trainer's bf16=True without DeepSpeed): RoPE leaves q and k in fp32
    beside a bf16 v, which the switch must take as SDPA does. {what: (ours, the unswitched model's)} errors
    against the unswitched fp32 model."""
    mesh = init_mesh(ulysses=1, ring=2)
    model, batch = build("llama"), BATCHES["full"]
    exact = reference(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unswitched = reference(model, batch)
        hf.apply(model, mesh)
        ours = case_errors(model, mesh, batch, exact)[0]
    theirs = {"logits": rel_err(unswitched[0], exact[0]), "loss": rel_err(unswitched[1], exact[1])}
    return {what: (ours[what], theirs[what]) for what in theirs}


@pytest.mark.distributed
def test_autocast_bf16_takes_q_k_v_as_sdpa_does():
    for what, (ours, theirs) in run_distributed(_autocast_errors, 2, timeout=300)[0].items():
        assert 0 < ours <= 2 * theirs + 1e-3, f"{what}: ours {ours:.2e} vs the unswitched model's {theirs:.2e}"
