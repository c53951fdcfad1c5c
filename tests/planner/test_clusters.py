"""``python -m hybridsp plan --clusters`` (hybridsp.planner._clusters): its rows are the planner's own
longest_context answers, and its loss what-if changes only the loss term of the fit test."""

from dataclasses import replace

from hybridsp.planner import MODELS, MeshConfig, SearchSpace, Workload, longest_context, memory_use, preset_cluster
from hybridsp.planner import _clusters as clusters
from hybridsp.planner._costs import local_tokens


def test_loss_what_if_replaces_only_the_loss_term():
    model, config = MODELS["llama3-8b"], MeshConfig(1, 8, 1, 3, True)
    workload = Workload(65536)
    plain, what_if = memory_use(model, workload, config), clusters.loss_at(14)(model, workload, config)
    assert what_if == replace(plain, logits=local_tokens(workload, config) * model.vocab_size * 14)
    chunked = replace(workload, chunked_loss=True)
    assert clusters.loss_at(14)(model, chunked, config) == memory_use(model, chunked, config)


def test_a_row_is_the_planners_longest_context():
    row = clusters.predict("llama3-8b", "h100", 8, 4096)
    cluster = preset_cluster("h100", 1, 8, "nvlink", "ib")
    space = SearchSpace(zero_stages=(3,), checkpointing=(False, True))
    found = longest_context(MODELS["llama3-8b"], cluster, granularity=4096, dtype_bytes=2, space=space)
    best = found.result.recommended
    assert row["seq_len"] == found.seq_len > 0 and row["gpus"] == 8 and row["nodes"] == 1
    assert (row["dp"], row["ulysses"], row["ring"]) == (best.config.dp, best.config.ulysses, best.config.ring)
    assert row["seq_len_loss_14b"] <= row["seq_len"] <= row["seq_len_chunked_loss"]
    assert "| llama3-8b | h100 | 8 (1) |" in clusters.markdown([row])
