"""Long-context inference with tensor parallelism: a tiny GQA Llama and a GQA Qwen2, saved as a
Hugging Face checkpoint, loaded by each rank straight into its tensor shards (built on ``meta``,
read through safetensors slices), switched to hybrid attention and run by
``hybridsp.integrations.transformers._generation`` with the K/V cache sharded over the sequence (C)
and the heads (T): the greedy ids equal the unmodified model's own ``generate``, the logits match,
and each rank's layer weights are 1/T of the model's."""

import pytest
import torch
import transformers

from hybridsp import init_mesh
from hybridsp.integrations import transformers as hf
from hybridsp.tensor_parallel._model_split import load_sharded_safetensors, tensor_plan
from hybridsp.testing import run_distributed
from tests.helpers.models.generation import COMMON, prompt, reference_generate
from tests.helpers.references.attention import rel_err

pytestmark = [pytest.mark.distributed, pytest.mark.integration]  # transformers checkpoints loaded and generated from

PROMPT, NEW, TOLERANCE = 64, 6, 1e-4
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),
}


def config_of(family):
    config_cls, _, overrides = FAMILIES[family]
    return getattr(transformers, config_cls)(**{**COMMON, **overrides})


def save_checkpoints(directory) -> dict:
    """{family: (checkpoint dir, expected ids, expected logits, full parameter bytes)}."""
    out = {}
    for family, (_, model_cls, _) in FAMILIES.items():
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config_of(family)).float().eval()
        ids, logits = reference_generate(model, prompt(2, PROMPT), max_new_tokens=NEW)
        path = f"{directory}/{family}"
        model.save_pretrained(path)
        out[family] = (path, ids, logits, sum(p.numel() * p.element_size() for p in model.parameters()))
    return out


def _rank(rank, world, meshes, checkpoints):
    failures, sizes = [], []
    for tensor, ulysses, ring in meshes:
        mesh = init_mesh(ulysses=ulysses, ring=ring, tensor=tensor)
        for family, (path, ref_ids, ref_logits, full_bytes) in checkpoints.items():
            with torch.device("meta"):  # nothing allocated: the whole model is never built on this rank
                model = getattr(transformers, FAMILIES[family][1])(config_of(family))
            hf.tensor_parallel(model, mesh)
            load_sharded_safetensors(model, path, dtype=torch.float32)
            model.eval()
            hf.apply(model, mesh, backend="torch")
            ids, logits = hf.generate(model, prompt(2, PROMPT), mesh=mesh, max_new_tokens=NEW, output_logits=True)
            where = f"T={tensor} U={ulysses} R={ring} {family}"
            if not torch.equal(ids, ref_ids):
                failures.append(f"{where}: ids {ids[:, PROMPT:].tolist()} != {ref_ids[:, PROMPT:].tolist()}")
            if rel_err(logits, ref_logits) > TOLERANCE:
                failures.append(f"{where}: logits differ by {rel_err(logits, ref_logits):.2e}")
            split = tensor_plan(model).split_dims
            params = dict(model.named_parameters())
            shard = sum(params[n].numel() * params[n].element_size() for n in split)
            local = sum(p.numel() * p.element_size() for p in params.values())
            sizes.append((where, shard, local, full_bytes))
    assert not failures, "\n".join(failures)
    return sizes


def _check_sizes(sizes, tensor=2):
    for where, shard, local, full in sizes:
        replicated = local - shard  # embeddings, LM head, norms
        assert replicated + shard * tensor == full, where  # the split weights are exactly 1/T each


def test_world_4_t2u2r1_greedy_generate_from_sharded_checkpoint_equals_model_generate(tmp_path):
    checkpoints = save_checkpoints(tmp_path)
    results = run_distributed(_rank, 4, [(2, 2, 1)], checkpoints, timeout=400)
    _check_sizes(results[0])


@pytest.mark.slow
def test_world_4_t2u1r2_greedy_generate_equals_model_generate(tmp_path):
    _check_sizes(run_distributed(_rank, 4, [(2, 1, 2)], save_checkpoints(tmp_path), timeout=400)[0])


@pytest.mark.slow
def test_world_8_t2u2r2_greedy_generate_equals_model_generate(tmp_path):
    checkpoints = save_checkpoints(tmp_path)
    _check_sizes(run_distributed(_rank, 8, [(2, 2, 2)], checkpoints, timeout=600)[0])
