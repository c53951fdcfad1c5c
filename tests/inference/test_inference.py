"""Inference without saved state: the hybrid attention under no_grad / inference_mode, and
examples/score_long.py (a whole text in one sharded forward) against the unmodified HF model."""

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridsp.testing import run_distributed
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.distributed


class _Allocations(TorchDispatchMode):
    """Weak references to every tensor an op creates inside the block."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        return result

    def alive_storages(self, *exclude: torch.Tensor) -> int:
        """Bytes of distinct storages still referenced by a tensor made in the block, except ``exclude``'s."""
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        alive = {}
        for ref in self.refs:
            tensor = ref()
            if tensor is not None and tensor.untyped_storage().nbytes():
                alive[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return sum(nbytes for ptr, nbytes in alive.items() if ptr not in skip)


def _attention_state(rank, world):
    """Per mode: how many tensors autograd saved, and the bytes of tensors made by the call that outlive it."""
    from hybridsp import hybrid_attn_func, init_mesh, shard_sequence
    from tests.helpers.references.attention import random_qkv

    mesh = init_mesh(ulysses=2, ring=2)
    q, k, v, _ = (shard_sequence(t, mesh).contiguous() for t in random_qkv(2, 64, 4, 1, 16, seed=3))
    results = {}
    for mode in ("grad", "no_grad", "inference_mode"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]  # even inputs that want gradients
        saved, allocations = [], _Allocations()
        context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
        with context(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            with allocations:
                out = hybrid_attn_func(*leaves, mesh=mesh, causal=True, backend="torch")
        results[mode] = {
            "saved": len(saved),
            "grad_fn": out.grad_fn is not None,
            "made": len(allocations.refs),
            "alive_bytes": allocations.alive_storages(out, *leaves),
            "out": out.numel() * 4,
        }
        del out
    return results


def test_no_grad_and_inference_mode_keep_nothing_for_backward():
    for rank_result in run_distributed(_attention_state, 4):
        grad, no_grad, inference = rank_result["grad"], rank_result["no_grad"], rank_result["inference_mode"]
        assert grad["saved"] > 0 and grad["grad_fn"] and grad["alive_bytes"] > 2 * grad["out"], grad  # the control
        for row in (no_grad, inference):
            assert row["saved"] == 0 and not row["grad_fn"] and row["made"] > 10, row
            assert row["alive_bytes"] == 0, row  # nothing but the output outlives the call


def _tiny_model_dir(directory: Path):
    from tests.helpers.models.tiny import tiny_causal_lm

    model = tiny_causal_lm(
        "llama",
        seed=1,
        dtype=None,
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    model.save_pretrained(directory)
    return model


def _score(rank, world, argv):
    sys.path.insert(0, str(ROOT / "examples"))
    import score_long

    return score_long.main(argv)


@pytest.mark.integration  # examples/score_long.py
@pytest.mark.slow  # ~35 s on the busy 2-core machine: 4 ranks load and score a saved model
def test_score_long_equals_the_unsharded_model(tmp_path):
    model = _tiny_model_dir(tmp_path / "model")
    text = ("A long document, scored in one forward pass over every rank. " * 12).strip()
    (tmp_path / "text.txt").write_text(text)
    argv = [
        "--model-path",
        str(tmp_path / "model"),
        "--data",
        str(tmp_path / "text.txt"),
        "--ulysses",
        "2",
        "--ring",
        "2",
        "--backend",
        "torch",
        "--chunk-size",
        "13",
        "--json-out",
        str(tmp_path / "out.json"),
    ]
    results = run_distributed(_score, 4, argv, timeout=240)
    ids = torch.tensor([list(text.encode())])
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    assert all(abs(r["nll_per_token"] - expected) <= 1e-5 * expected for r in results), (results[0], expected)
    assert results[0]["tokens"] == ids.shape[1] and abs(results[0]["perplexity"] - torch.tensor(expected).exp()) < 1e-3
    assert all(p > 0 for p in results[0]["peak_memory_bytes_per_rank"])
    assert (tmp_path / "out.json").exists()
