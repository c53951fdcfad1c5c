"""Generation of hybrid linear-attention models under U x R: ``hybridsp.integrations.transformers.generate`` on a
switched Qwen3.5 / Nemotron-H (the recurrent layers' final state and conv tail kept on every context rank after the
sharded prefill, stepped locally in decode) against the unmodified model's own ``model.generate``: greedy ids equal,
the logits that chose each token within a relative 1e-5 (measured at most 3.4e-7). The bound is tight because the
tiny Nemotron-H's decode depends little on its Mamba-2 state: decoding from a zero state or from the state after
the prompt's right padding moves its logits by 4.2e-5 and 4.5e-5 relative (a zero conv tail changes its ids; each of
the three changes Qwen3.5's logits by 0.16 to 1.3)."""

from __future__ import annotations

import pytest
import torch

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from hybridsp.testing import run_distributed
from tests.helpers.models.linear import packed_batch, tiny_hybrid
from tests.helpers.workers.linear import generation_errors

pytestmark = pytest.mark.distributed

TOLERANCE = 1e-5


def _check(found: dict) -> None:
    for name, (equal, error) in found.items():
        assert equal, f"{name}: greedy ids differ from model.generate (logits' relative error {error:.2e})"
        assert error < TOLERANCE, f"{name}: logits' relative error {error:.2e}"


def test_greedy_ids_equal_model_generate():
    """B = 2, U2xR2 (a 13-token prompt: right padding to 16 stays out of the state) and U1xR2 (a 2-token prompt,
    shorter than the conv window), both mixer kinds, in one 4-rank spawn."""
    cases = [
        ("qwen3_5 U2xR2", "qwen3_5", 2, 2, 13, 5),
        ("qwen3_5 U1xR2", "qwen3_5", 1, 2, 2, 5),
        ("nemotron_h U2xR2", "nemotron_h", 2, 2, 13, 5),
        ("nemotron_h U1xR2", "nemotron_h", 1, 2, 7, 5),
    ]
    _check(run_distributed(generation_errors, 4, cases, timeout=400)[0])


@pytest.mark.slow
def test_greedy_ids_qwen3_next_three_ring_ranks_and_balanced():
    """Qwen3-Next (fused projections) at U1xR3, a longer prompt at U1xR3 for both other families, a one-token
    prompt, and the balanced layout."""
    cases = [
        ("qwen3_next U1xR3", "qwen3_next", 1, 3, 29, 6),
        ("qwen3_5 U1xR3", "qwen3_5", 1, 3, 40, 6),
        ("nemotron_h U1xR3", "nemotron_h", 1, 3, 40, 6),
        ("qwen3_5 U1xR3 one-token prompt", "qwen3_5", 1, 3, 1, 4),
        ("nemotron_h U1xR3 balanced", "nemotron_h", 1, 3, 23, 4, "balanced"),
    ]
    _check(run_distributed(generation_errors, 3, cases, timeout=400)[0])


EOS_PROMPT, EOS_NEW = 9, 4
EOS_CASES = {  # case -> generate's keyword arguments, the same for hybridsp's generate and model.generate
    "eos_token_id=None": dict(eos_token_id=None),
    "not passed": {},
    "pad_token_id=None": dict(pad_token_id=None),
}


def _eos_prompt():
    """[2, 9] prompt; the first greedy token of row 0 becomes the model's EOS, row 1 starts with another one."""
    return packed_batch(((EOS_PROMPT,), (EOS_PROMPT,)), seed=3)["input_ids"]


def _eos_model():
    model = tiny_hybrid("qwen3_next").eval()
    with torch.inference_mode():
        first = model(input_ids=_eos_prompt()).logits[:, -1].argmax(-1)  # [2] the first greedy tokens
    model.generation_config.eos_token_id = int(first[0])
    model.generation_config.pad_token_id = 0
    return model, first


def _eos_rank(rank: int, world: int) -> dict:
    model, _ = _eos_model()
    mesh = init_mesh(ulysses=1, ring=2)
    with hf.apply(model, mesh):
        return {
            case: hf.generate(model, _eos_prompt(), mesh=mesh, max_new_tokens=EOS_NEW, **kwargs)
            for case, kwargs in EOS_CASES.items()
        }


def test_eos_token_id_none_passed_keeps_generating_as_model_generate():
    """Qwen3-Next at U1xR2, B = 2, greedy, the model's EOS set to row 0's first greedy token: ``eos_token_id=None``
    passed keeps generating (as ``model.generate``), not passed stops row 0 at once and pads it with the config's
    pad (0), ``pad_token_id=None`` passed pads with the EOS: ids equal ``model.generate``'s with the same
    arguments in every case, on both ranks."""
    model, first = _eos_model()
    assert first[0] != first[1], "setup: row 1 must not start with the EOS"
    expected = {
        case: model.generate(_eos_prompt(), max_new_tokens=EOS_NEW, do_sample=False, **kwargs)
        for case, kwargs in EOS_CASES.items()
    }
    eos, new = int(first[0]), slice(EOS_PROMPT + 1, None)
    assert expected["eos_token_id=None"].shape[1] == EOS_PROMPT + EOS_NEW
    assert (expected["not passed"][0, new] == 0).all() and (expected["pad_token_id=None"][0, new] == eos).all()
    for rank, found in enumerate(run_distributed(_eos_rank, 2, timeout=300)):
        for case, ids in found.items():
            assert torch.equal(ids, expected[case]), f"rank {rank}, {case}: {ids.tolist()} != {expected[case].tolist()}"
