"""A model transformers split with its own tensor parallelism (``from_pretrained(..., tp_plan="auto")``) is
refused by ``apply`` and ``check_switchable`` on every rank, before any collective (issue 47): its row-parallel
all-reduce would add partial outputs of different tokens once the ranks hold different parts of the sequence."""

import pytest

from hybridsp.testing import run_distributed
from tests.helpers.models.tiny import tiny_causal_lm

pytestmark = [pytest.mark.distributed, pytest.mark.integration, pytest.mark.slow]  # the logic: test_token_mixers.py

MOE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


def _load_split_and_switch(rank: int, world: int, path: str) -> tuple[int, str, str]:
    from transformers import AutoModelForCausalLM

    from hybridsp import init_mesh
    from hybridsp.integrations import transformers as hf

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
    mesh = init_mesh(1, world)
    answers = []
    for ask in (hf.check_switchable, hf.apply):
        try:
            ask(model, mesh)
            answers.append("accepted")
        except ValueError as error:
            answers.append(str(error))
    return model.tp_size, *answers


def test_a_model_loaded_with_tp_plan_is_refused(tmp_path):
    tiny_causal_lm("qwen3_moe", **MOE).save_pretrained(tmp_path)
    for tp_size, preflight, applied in run_distributed(_load_split_and_switch, 2, str(tmp_path), timeout=300):
        assert tp_size == 2
        assert preflight == applied
        assert "split by transformers' tensor parallelism (tp_size=2" in applied
