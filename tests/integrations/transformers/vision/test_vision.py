"""Vision-language models (tiny Qwen2-VL / Qwen2.5-VL, fp64, gloo on CPU) against the unmodified model.

A switched model on U x R ranks, fed by ``shard_vlm_batch``, must give the unmodified model's
logits and loss on the full batch, and gradients (summed over the context ranks) equal to the
unmodified model's, for two rows holding several images and a multi-frame video whose tokens
span several shards; both ways of dividing the vision encoder's work ("local", "split").
``generate_vlm`` must give ``model.generate``'s greedy ids. The language model's attention is
the only one switched (the vision tower keeps sdpa).
"""

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.workers.vlm import generate_matches, mixed_batch, sharded_forward, tiny_vlm

pytestmark = pytest.mark.integration

LOGITS_TOLERANCE, LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-9, 1e-5, 1e-7
# fp64 models; the sharded loss is reduced in fp32. Measured: logits <= 2e-16, loss <= 5e-7, gradients <= 2e-9 relative.


def _check(results: list[list[dict]], modes: list[str]) -> None:
    for rank, per_mode in enumerate(results):
        for mode, result in zip(modes, per_mode):
            where = f"rank {rank}, vision={mode}"
            assert result["logits"] < LOGITS_TOLERANCE, f"{where}: logits differ by {result['logits']}"
            assert result["loss"] < LOSS_TOLERANCE, f"{where}: loss differs by {result['loss']}"
            assert result["grad"] < GRAD_TOLERANCE, f"{where}: gradients differ by {result['grad']} (relative)"
            assert result["vision_grads"] > 0


@pytest.mark.distributed
def test_qwen2_vl_two_ranks_equals_unsharded():
    modes = ["local", "split"]
    _check(run_distributed(sharded_forward, 2, "qwen2_vl", 2, 1, modes, timeout=300), modes)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind,ulysses,ring", [("qwen2_5_vl", 2, 2), ("qwen2_5_vl", 1, 4), ("qwen2_vl", 2, 2)])
def test_four_ranks_equal_unsharded(kind, ulysses, ring):
    modes = ["local", "split"]
    _check(run_distributed(sharded_forward, 4, kind, ulysses, ring, modes, timeout=600), modes)


def test_split_mode_balances_and_local_mode_repeats_only_boundary_units():
    """The patches each rank encodes: split ~ total / C each; local >= total (boundary units twice)."""
    from hybridsp.integrations.transformers._vision.batch import plan_vision
    from tests.helpers.mesh import mesh_at

    model, batch = tiny_vlm(), mixed_batch()
    total = batch["pixel_values"].shape[0] + batch["pixel_values_videos"].shape[0]
    ids = torch.nn.functional.pad(batch["input_ids"], (0, 4))  # [2, 56]: a multiple of 2R * U = 8
    for mode in ("local", "split"):
        meshes = [mesh_at(2, 2, r, u) for r in range(2) for u in range(2)]
        patches = [plan_vision(batch, ids, mesh, model, mode).pixels.shape[0] for mesh in meshes]
        if mode == "split":
            assert sum(patches) == total and max(patches) - min(patches) <= 48, patches
        else:
            assert total <= sum(patches) < total + 7 * 48, patches  # at most one unit per shard boundary


@pytest.mark.distributed
def test_generate_equals_model_generate():
    result = run_distributed(generate_matches, 2, "qwen2_vl", 2, 1, 6, timeout=300)[0]
    assert result["ours"] == result["expected"]


@pytest.mark.distributed
@pytest.mark.slow
def test_generate_qwen2_5_vl_on_four_ranks_equals_model_generate():
    result = run_distributed(generate_matches, 4, "qwen2_5_vl", 2, 2, 8, timeout=600)[0]
    assert result["ours"] == result["expected"]


def test_bad_batches_raise_clear_errors():
    from hybridsp.integrations.transformers._vision.batch import shard_vlm_batch
    from tests.helpers.mesh import mesh_at

    model, batch, mesh = tiny_vlm(), mixed_batch(), mesh_at(2, 1, 0)
    with pytest.raises(ValueError, match="image tokens .* give"):
        shard_vlm_batch({**batch, "image_grid_thw": batch["image_grid_thw"][:-1]}, mesh, model)
    with pytest.raises(ValueError, match="does not know how to shard"):
        shard_vlm_batch({**batch, "token_type_ids": batch["input_ids"]}, mesh, model)
    with pytest.raises(ValueError, match="vision must be one of"):
        shard_vlm_batch(batch, mesh, model, vision="everywhere")
    with pytest.raises(ValueError, match="zigzag or contiguous layout; got layout 'balanced'"):
        shard_vlm_batch(batch, mesh_at(2, 1, 0, layout="balanced"), model)


def test_apply_switches_the_language_model_only_and_refuses_other_vision_models():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    from hybridsp.integrations.transformers import apply
    from tests.helpers.mesh import mesh_at

    model = tiny_vlm()
    with apply(model, mesh_at(2, 1, 0)):
        assert model.config.text_config._attn_implementation == "hybridsp"
        assert model.config.vision_config._attn_implementation == "sdpa"
        with pytest.raises(ValueError, match="already switched"):
            apply(model, mesh_at(2, 1, 0))
    assert model.config.text_config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="divisible by the Ulysses degree 8"):
        apply(model, mesh_at(8, 1, 0))
    llava = LlavaForConditionalGeneration(
        LlavaConfig(
            vision_config=dict(
                model_type="clip_vision_model",
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            text_config=dict(
                model_type="llama",
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=4,
            ),
        )
    )
    with pytest.raises(ValueError, match="'llava' has a vision encoder"):
        apply(llava, mesh_at(2, 1, 0))
    assert llava.config.vision_config._attn_implementation != "hybridsp"


def test_auto_splits_clustered_images_and_keeps_a_spread_video_local():
    from hybridsp.integrations.transformers._vision.batch import plan_vision
    from hybridsp.mesh._hybrid_mesh import padded_length
    from tests.helpers.mesh import mesh_at
    from tests.helpers.workers.vlm import collate, sample

    model, generator = tiny_vlm(), torch.Generator().manual_seed(0)
    meshes = [mesh_at(2, 2, r, u) for r in range(2) for u in range(2)]
    clustered = collate([sample(generator, [("image", (1, 4, 4))] * 6 + [200])])  # images in the first eighth
    spread = collate([sample(generator, [3, ("video", (96, 4, 4)), 5])])  # 384 video tokens over the whole row
    for batch, expected in ((clustered, "split"), (spread, "local")):
        ids = batch["input_ids"]
        ids = torch.nn.functional.pad(ids, (0, padded_length(ids.shape[1], meshes[0]) - ids.shape[1]))
        for mesh in meshes:
            auto, chosen = (plan_vision(batch, ids, mesh, model, mode) for mode in ("auto", expected))
            assert torch.equal(auto.grid, chosen.grid) and (auto.exchange is None) == (expected == "local")
