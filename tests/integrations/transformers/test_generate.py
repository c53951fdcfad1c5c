"""Long-context inference: prefill through the hybrid attention, decode against a K/V cache that stays
sharded, and hybridsp.integrations.transformers._generation, against the unmodified Hugging Face model
(``model.generate`` and plain forwards in one process) and float64 attention math."""

import math

import pytest
import torch

from hybridsp import gather_sequence, init_mesh
from hybridsp.inference import ShardedKVCache, assign_new_tokens, decode_attention
from hybridsp.integrations import transformers as hf
from hybridsp.integrations.transformers._generation import choose_next_tokens
from tests.helpers.mesh import mesh_at
from tests.helpers.models.generation import build, launch, portable, prompt, reference_generate

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
PROMPT, NEW = 128, 8
MESHES_AT_WORLD4 = ((2, 2), (1, 4), (4, 1))  # (ulysses, ring) at world 4
# Seeds: model weights and prompts come from seed 0. For these seeds the unmodified model's greedy
# choice at every one of the 8 steps, for every row, beats the runner-up logit by >= 7.6e-3 (llama)
# and >= 1.1e-2 (qwen2) (seeds 1-3 have gaps down to 3e-5), while the sharded logits differ from the
# unmodified ones by ~1e-6: no near-tie can flip an argmax. The tests assert both facts.
MIN_MARGIN = 1e-3


def prompt_logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits.float()  # [B, S, V]


def sharded_prompt_logits(model, ids, mesh) -> torch.Tensor:
    """The prefill's logits of every prompt token, gathered: [B, S, V]."""
    state = hf.prefill(model, ids, mesh=mesh, all_logits=True)
    return gather_sequence(state.local_logits.float(), mesh)[:, : ids.shape[1]]


def assert_same_on_all_ranks(results, key):
    def flat(value):
        return list(value) if isinstance(value, (tuple, list)) else [value]

    for rank, result in enumerate(results[1:], start=1):
        same = all(torch.equal(a, b) for a, b in zip(flat(result[key]), flat(results[0][key])))
        assert same, f"rank {rank} disagrees with rank 0 on {key}"


# ---------------------------------------------------------------- greedy generate at W = 4, three meshes


def _three_meshes_rank(rank, world):
    results = {}
    for ulysses, ring in MESHES_AT_WORLD4:
        mesh = init_mesh(ulysses=ulysses, ring=ring)
        for family in ("llama", "qwen2"):
            model = build(family)
            handle = hf.apply(model, mesh)
            for batch in (1, 2):
                ids = prompt(batch, PROMPT)
                out, logits = hf.generate(model, ids, mesh=mesh, max_new_tokens=NEW, output_logits=True)
                results[ulysses, ring, family, batch] = dict(
                    ids=out, logits=logits, prompt_logits=sharded_prompt_logits(model, ids, mesh)
                )
            handle.undo()
    return portable(results)


@pytest.mark.distributed
def test_greedy_ids_and_logits_equal_the_unmodified_model_on_three_meshes():
    """W=4 as U2xR2, U1xR4, U4xR1; tiny Llama (MQA) and Qwen2 (GQA 8/2, K/V heads < U=4); B=1, 2;
    prompt 128, 8 new tokens: ids equal model.generate's exactly, the prompt's and every decode step's
    logits within 1e-4, on every rank, with an asserted argmax margin."""
    results = launch(_three_meshes_rank, 4)
    for family in ("llama", "qwen2"):
        model = build(family)
        for batch in (1, 2):
            ids = prompt(batch, PROMPT)
            ref_ids, ref_logits = reference_generate(model, ids, max_new_tokens=NEW)
            assert ref_ids.shape == (batch, PROMPT + NEW)
            top2 = ref_logits.topk(2, dim=-1).values
            margin = (top2[..., 0] - top2[..., 1]).min().item()
            assert margin >= MIN_MARGIN, f"{family} B={batch}: seed gives a near-tie ({margin:.1e})"
            ref_prompt = prompt_logits(model, ids)
            for ulysses, ring in MESHES_AT_WORLD4:
                case = f"{family} B={batch} U{ulysses}xR{ring}"
                per_rank = [r[ulysses, ring, family, batch] for r in results]
                for key in ("ids", "logits", "prompt_logits"):
                    assert_same_on_all_ranks(per_rank, key)
                got = per_rank[0]
                assert torch.equal(got["ids"], ref_ids), f"{case}: {got['ids'][:, PROMPT:]} vs {ref_ids[:, PROMPT:]}"
                decode_err = (got["logits"] - ref_logits).abs().max().item()
                prompt_err = (got["prompt_logits"] - ref_prompt).abs().max().item()
                assert decode_err < TOLERANCE and prompt_err < TOLERANCE, f"{case}: {decode_err:.1e} {prompt_err:.1e}"
                assert margin > 2 * decode_err, f"{case}: margin {margin:.1e} vs error {decode_err:.1e}"


# ------------------------------------------- a mesh built with layout="balanced"

BALANCED_PROMPTS = (PROMPT, 37)  # 37: padded on the right to the layout's multiple


def _balanced_rank(rank, world):
    results = {}
    for ulysses, ring in ((1, 2), (2, 1)):
        mesh = init_mesh(ulysses=ulysses, ring=ring, layout="balanced")
        model = build("llama")
        with hf.apply(model, mesh):
            for length in BALANCED_PROMPTS:
                ids = prompt(2, length)
                out, logits = hf.generate(model, ids, mesh=mesh, max_new_tokens=NEW, output_logits=True)
                results[ulysses, ring, length] = dict(
                    ids=out, logits=logits, prompt_logits=sharded_prompt_logits(model, ids, mesh)
                )
    return portable(results)


@pytest.mark.distributed
def test_generate_on_a_balanced_mesh_equals_the_unmodified_model():
    """Before: ValueError asking for hybridsp_documents, which generate cannot pass. Now the prefill hands
    the model one document per row (balanced places it as zigzag): ids equal model.generate's."""
    results = launch(_balanced_rank, 2)
    model = build("llama")
    for length in BALANCED_PROMPTS:
        ids = prompt(2, length)
        ref_ids, ref_logits = reference_generate(model, ids, max_new_tokens=NEW)
        ref_prompt = prompt_logits(model, ids)
        top2 = ref_logits.topk(2, dim=-1).values
        margin = (top2[..., 0] - top2[..., 1]).min().item()
        for ulysses, ring in ((1, 2), (2, 1)):
            case = f"balanced U{ulysses}xR{ring} S={length}"
            per_rank = [r[ulysses, ring, length] for r in results]
            for key in ("ids", "logits"):
                assert_same_on_all_ranks(per_rank, key)
            got = per_rank[0]
            assert torch.equal(got["ids"], ref_ids), f"{case}: {got['ids'][:, length:]} vs {ref_ids[:, length:]}"
            decode_err = (got["logits"] - ref_logits).abs().max().item()
            prompt_err = (got["prompt_logits"] - ref_prompt).abs().max().item()
            assert decode_err < TOLERANCE and prompt_err < TOLERANCE, f"{case}: {decode_err:.1e} {prompt_err:.1e}"
            assert margin > 2 * decode_err, f"{case}: margin {margin:.1e} vs error {decode_err:.1e}"


def test_left_padding_on_a_balanced_mesh_is_refused_before_any_collective():
    mesh = mesh_at(ulysses=1, ring=2, layout="balanced")  # no process groups: a collective would fail
    model = build("llama")
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :3] = 0
    with hf.apply(model, mesh):
        for call in (hf.generate, hf.prefill):
            with pytest.raises(
                ValueError,
                match=r"layout='balanced' mesh takes prompts without left padding.*"
                r"layout='zigzag'",
            ):
                call(model, prompt(2, 16), mesh=mesh, max_new_tokens=2, attention_mask=mask)


# ------------------------------------------- padding, EOS, sampling, all families, bf16, DP replicas


def _features_rank(rank, world, eos_id):
    results = {}
    mesh = init_mesh(ulysses=2, ring=2)
    model = build("qwen2")
    with hf.apply(model, mesh):
        results["padded"] = hf.generate(model, prompt(2, 125), mesh=mesh, max_new_tokens=NEW)  # pads to 128
        results["tiny"] = hf.generate(model, prompt(2, 3), mesh=mesh, max_new_tokens=NEW)  # shards of padding only
        results["eos"] = hf.generate(
            model, prompt(2, 64), mesh=mesh, max_new_tokens=NEW, eos_token_id=eos_id, pad_token_id=0
        )
        torch.manual_seed(SAMPLE_SEED)  # the global generator, seeded alike on every rank
        results["sampled"] = hf.generate(model, prompt(2, 64), mesh=mesh, max_new_tokens=NEW, **SAMPLING)
        draws = [
            hf.generate(
                model,
                prompt(2, 64),
                mesh=mesh,
                max_new_tokens=NEW,
                **SAMPLING,
                generator=torch.Generator().manual_seed(SAMPLE_SEED),
            )
            for _ in range(2)
        ]
        results["generator"] = draws
        results["none"] = hf.generate(model, prompt(2, 64), mesh=mesh, max_new_tokens=0)
        streamer = Recorder()
        results["streamed"] = hf.generate(model, prompt(2, 64), mesh=mesh, max_new_tokens=4, streamer=streamer)
        results["stream"] = streamer.pieces
    for family in ("mistral", "qwen3"):
        model = build(family)
        with hf.apply(model, mesh):
            results[family] = hf.generate(model, prompt(2, 100), mesh=mesh, max_new_tokens=NEW, output_logits=True)
    model = build("llama", dtype=torch.bfloat16)
    with hf.apply(model, mesh):
        results["bf16"] = hf.generate(model, prompt(2, PROMPT), mesh=mesh, max_new_tokens=NEW, output_logits=True)
        results["bf16_prompt"] = sharded_prompt_logits(model, prompt(2, PROMPT), mesh)
    replicas = init_mesh(ulysses=1, ring=2)  # DP = 2: each replica continues its own prompt
    model = build("llama")
    with hf.apply(model, replicas):
        results["dp"] = hf.generate(model, prompt(2, 96, seed=10 + replicas.dp_rank), mesh=replicas, max_new_tokens=NEW)
    return portable(results)


SAMPLE_SEED = 1234


class Recorder:
    """transformers' streamer protocol: put(prompt [B, S]), put(token [B]) per new token, end()."""

    def __init__(self):
        self.pieces = []

    def put(self, ids):
        self.pieces.append(ids.clone())

    def end(self):
        self.pieces.append("end")


SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)


def _eos_id() -> int:
    """A token that greedy qwen2 emits at step 3 of row 0 (and not before), so EOS stops that row mid-way."""
    ids, _ = reference_generate(build("qwen2"), prompt(2, 64), max_new_tokens=NEW, eos_token_id=None)
    new = ids[0, 64:].tolist()
    return next(t for i, t in enumerate(new) if i >= 2 and t not in new[:i] and t not in ids[1, 64:].tolist())


@pytest.mark.distributed
def test_padding_eos_sampling_families_bf16_and_replicas():
    eos_id = _eos_id()
    results = launch(_features_rank, 4, eos_id)
    for key in ("padded", "tiny", "eos", "sampled", "none", "mistral", "qwen3", "bf16"):
        assert_same_on_all_ranks(results, key)
    got = results[0]
    qwen2 = build("qwen2")
    for key, seq in (("padded", 125), ("tiny", 3)):
        assert torch.equal(got[key], reference_generate(qwen2, prompt(2, seq), max_new_tokens=NEW)[0]), key
    ref_eos, _ = reference_generate(qwen2, prompt(2, 64), max_new_tokens=NEW, eos_token_id=eos_id, pad_token_id=0)
    assert torch.equal(got["eos"], ref_eos) and (got["eos"][0, 64:] == 0).any(), (got["eos"], ref_eos)
    torch.manual_seed(SAMPLE_SEED)
    ref_sampled = qwen2.generate(prompt(2, 64), max_new_tokens=NEW, **SAMPLING)
    assert torch.equal(got["sampled"], ref_sampled), "sampling with the same seed differs from model.generate"
    first, again = got["generator"]
    assert torch.equal(first, again) and all(torch.equal(r["generator"][0], first) for r in results)
    assert torch.equal(got["none"], prompt(2, 64))
    *pieces, end = got["stream"]
    assert end == "end" and torch.equal(torch.cat([pieces[0]] + [p[:, None] for p in pieces[1:]], 1), got["streamed"])
    for family in ("mistral", "qwen3"):
        ids, logits = got[family]
        ref_ids, ref_logits = reference_generate(build(family), prompt(2, 100), max_new_tokens=NEW)
        assert torch.equal(ids, ref_ids) and (logits - ref_logits).abs().max() < TOLERANCE, family
    _assert_bf16(got)
    for replica in (0, 1):  # ranks 2*replica, 2*replica + 1 form replica `replica`
        ref, _ = reference_generate(build("llama"), prompt(2, 96, seed=10 + replica), max_new_tokens=NEW)
        for rank in (2 * replica, 2 * replica + 1):
            assert torch.equal(results[rank]["dp"], ref), f"replica {replica}, rank {rank}"


def _assert_bf16(got):
    """bf16 by flash-attn's rule: the sharded error against fp32 math is at most ~2x the unmodified bf16 model's."""
    model = build("llama", dtype=torch.bfloat16)
    exact = build("llama", dtype=torch.bfloat16).float()  # the same (bf16-rounded) weights, fp32 math
    ids, logits = got["bf16"]
    forced = ids[:, :-1]  # teacher-forced: the logits that chose each new token are at positions S-1 .. S+new-2
    truth = prompt_logits(exact, forced)[:, PROMPT - 1 :]
    baseline = prompt_logits(model, forced)[:, PROMPT - 1 :]
    ours, theirs = (logits - truth).abs().max().item(), (baseline - truth).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, f"bf16 decode logits: error {ours:.2e} vs unmodified bf16 {theirs:.2e}"
    truth, baseline = prompt_logits(exact, prompt(2, PROMPT)), prompt_logits(model, prompt(2, PROMPT))
    ours, theirs = (got["bf16_prompt"] - truth).abs().max().item(), (baseline - truth).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, f"bf16 prompt logits: error {ours:.2e} vs unmodified bf16 {theirs:.2e}"


# ------------------------------------------------ decode attention against float64 math, odd ring of 3


def _random_cache(seed, batch, lengths, kv_heads, head_dim, dtype):
    """Per-rank K/V shards [B, L_r, Hkv, D] of one cache, and the global position of every cached token."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    k = torch.randn(batch, total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, total, kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.randperm(total, generator=gen)  # shards hold scattered positions, as zigzag does
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return k, v, positions, bounds


def _reference_decode(q, k, v, q_pos, k_pos, window):
    """float64 attention of q [B, T, H, D] over the whole cache with the causal/window mask."""
    group = q.shape[2] // k.shape[2]
    keys, values = (t.double().repeat_interleave(group, dim=2) for t in (k, v))  # [B, L, H, D]
    scores = torch.einsum("bthd,blhd->bhtl", q.double(), keys) / math.sqrt(q.shape[-1])
    distance = q_pos[:, None] - k_pos[None, :]
    visible = (distance >= 0) & (distance < (window or 10**9))
    return torch.einsum("bhtl,blhd->bthd", scores.masked_fill(~visible, -math.inf).softmax(-1), values)


DECODE_CASES = [  # (kv heads, new tokens T, window, dtype)
    (1, 1, None, torch.float32),
    (2, 1, None, torch.bfloat16),
    (2, 3, None, torch.float32),
    (1, 1, 9, torch.float32),
    (2, 3, 6, torch.bfloat16),
]


def _decode_rank(rank, world):
    mesh = init_mesh(ulysses=1, ring=3)
    lengths = (5, 0, 11)  # one rank holds nothing
    outs = []
    for index, (kv_heads, t, window, dtype) in enumerate(DECODE_CASES):
        k, v, positions, bounds = _random_cache(index, 2, lengths, kv_heads, 16, dtype)
        q = torch.randn(2, t, 4, 16, generator=torch.Generator().manual_seed(100 + index)).to(dtype)
        q_pos = torch.arange(sum(lengths) - t + 1, sum(lengths) + 1) if t > 1 else torch.tensor([sum(lengths)])
        mine = slice(bounds[mesh.context_rank], bounds[mesh.context_rank + 1])
        outs.append(
            decode_attention(
                q,
                k[:, mine],
                v[:, mine],
                mesh=mesh,
                query_positions=q_pos,
                key_positions=positions[mine],
                window=window,
            )
        )
    model = build("qwen2")
    with hf.apply(model, mesh):
        ids = hf.generate(model, prompt(2, 100), mesh=mesh, max_new_tokens=NEW)  # 100 pads to 102 for R=3
    return portable((outs, ids))


@pytest.mark.distributed
def test_decode_attention_matches_float64_on_an_odd_ring():
    """W=3 (ring 3, one empty shard): GQA down to 1 K/V head, T=1 and T=3 causal, sliding windows, fp32 and
    bf16 against float64 math; identical bits on every rank; and generate on the odd ring equals model.generate."""
    results = launch(_decode_rank, 3)
    lengths = (5, 0, 11)
    for index, (kv_heads, t, window, dtype) in enumerate(DECODE_CASES):
        k, v, positions, _ = _random_cache(index, 2, lengths, kv_heads, 16, dtype)
        q = torch.randn(2, t, 4, 16, generator=torch.Generator().manual_seed(100 + index)).to(dtype)
        q_pos = torch.arange(sum(lengths) - t + 1, sum(lengths) + 1) if t > 1 else torch.tensor([sum(lengths)])
        expected = _reference_decode(q, k, v, q_pos, positions, window)
        for rank in (1, 2):
            assert torch.equal(results[rank][0][index], results[0][0][index]), f"case {index}: rank {rank} differs"
        got = results[0][0][index]
        assert got.dtype == dtype and got.shape == q.shape
        error = (got.double() - expected).abs().max().item()
        if dtype == torch.float32:
            assert error < 1e-5, f"case {index}: {error:.1e}"
        else:  # flash-attn's rule against the same math done in bf16 on one process
            same_dtype = _reference_decode(q, k, v, q_pos, positions, window).to(dtype)
            assert error <= 2 * (same_dtype.double() - expected).abs().max().item() + 1e-2, f"case {index}: {error}"
    ref, _ = reference_generate(build("qwen2"), prompt(2, 100), max_new_tokens=NEW)
    assert all(torch.equal(ids, ref) for _, ids in results)


# ------------------------------------------------------------------------ no communication needed


def test_new_tokens_balance_the_shards():
    assert assign_new_tokens([5, 3, 3, 4], 6) == [1, 2, 1, 2, 3, 0]
    lengths = [10, 0, 7]
    owners = assign_new_tokens(lengths, 40)
    final = [n + owners.count(i) for i, n in enumerate(lengths)]
    assert max(final) - min(final) <= 1 and sum(final) == 57


def test_cache_is_preallocated_exactly_and_refuses_overflow():
    mesh = mesh_at(ulysses=1, ring=2, r=1)  # shard 1 of 2
    cache = ShardedKVCache(mesh, 2, positions=torch.tensor([1, 2]), shard_lengths=[3, 2], new_tokens=3)
    assert cache.owners == [1, 0, 1] and cache.capacity == 4
    for layer in range(2):
        cache.write(layer, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    for position in (5, 6):
        mine = cache.begin_token(position)
        for layer in range(2):
            if mine:
                cache.write(layer, torch.full((1, 2, 1, 4), float(position)), torch.zeros(1, 2, 1, 4))
    keys, values = cache.layer(1)
    assert keys.shape == (1, 2, 3, 4) and keys[0, 0, 2, 0] == 5 and cache.key_positions(1).tolist() == [1, 2, 5]
    assert cache.total_tokens == 7 and cache.nbytes() == 2 * 2 * (2 * 4 * 4) * 4
    cache.begin_token(7)
    with pytest.raises(ValueError, match=r"sized for 3 new tokens"):
        cache.begin_token(8)
    with pytest.raises(ValueError, match=r"exceed this shard's capacity 4"):
        cache.write(0, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))


def test_sampling_filters_match_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    warped = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8)):
        warped = warper(None, warped)
    for seed in range(5):
        ours = choose_next_tokens(
            logits, do_sample=True, temperature=0.7, top_k=10, top_p=0.8, generator=torch.Generator().manual_seed(seed)
        )
        theirs = torch.multinomial(warped.softmax(-1), 1, generator=torch.Generator().manual_seed(seed)).squeeze(1)
        assert torch.equal(ours, theirs)
    assert torch.equal(choose_next_tokens(logits), logits.argmax(-1))


@pytest.mark.parametrize(
    "call, match",
    [
        (dict(input_ids=torch.ones(4, dtype=torch.long)), r"input_ids must be an int64 tensor \[B, S\]; got \(4,\)"),
        (dict(input_ids=torch.ones(2, 0, dtype=torch.long)), r"at least one token per row; got shape \(2, 0\)"),
        (dict(max_new_tokens=-1), r"max_new_tokens must be an integer >= 0; got -1"),
        (dict(do_sample=True, temperature=0.0), r"temperature must be > 0 for sampling; got 0.0"),
        (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]; got 1.5"),
        (dict(do_sample=True, top_k=0), r"top_k must be None or an integer >= 1; got 0"),
        (dict(mesh="other"), r"switched with a different mesh"),
    ],
)
def test_bad_arguments_are_refused_before_any_collective(call, match):
    mesh = mesh_at(ulysses=2, ring=2)  # no process groups: a collective would fail, not hang
    model = build("qwen2")
    with hf.apply(model, mesh):
        arguments = {**dict(input_ids=prompt(2, 16), mesh=mesh, max_new_tokens=4), **call}
        if arguments["mesh"] == "other":
            arguments["mesh"] = mesh_at(ulysses=2, ring=2)
        with pytest.raises(ValueError, match=match):
            hf.generate(model, **arguments)


def test_a_model_that_is_not_switched_is_refused():
    with pytest.raises(ValueError, match=r"is not switched to hybridsp: call .*apply\(model, mesh\)"):
        hf.generate(build("llama"), prompt(1, 8), mesh=mesh_at(1, 2), max_new_tokens=2)


def test_the_switched_model_still_refuses_a_cache_outside_generate():
    mesh = mesh_at(ulysses=1, ring=1)
    model = build("llama")
    with hf.apply(model, mesh):
        out = model(input_ids=prompt(1, 8), position_ids=torch.arange(8)[None], use_cache=True)
        with pytest.raises(ValueError, match=r"only supported through hybridsp.integrations.transformers._generation"):
            model(input_ids=prompt(1, 1), position_ids=torch.tensor([[8]]), cache=out.cache, use_cache=True)
