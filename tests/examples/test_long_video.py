"""examples/long_video.py: its patches are Qwen2-VL's processor's, its sharded score is the
unsharded model's loss, and user errors exit with code 2."""

import importlib.util

import pytest
import torch

from hybridsp.testing import run_distributed
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "examples" / "long_video.py"


def _example():
    spec = importlib.util.spec_from_file_location("long_video", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_patches_are_laid_out_as_the_image_processor_does():
    pytest.importorskip("PIL")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    example = _example()
    frame = example.draw_frames(3, 84)[1]  # [3, 84, 84]
    ours, grid = example.frames_to_patches(torch.stack([frame, frame]))  # an image is a frame shown twice
    processor = Qwen2VLImageProcessorPil(
        do_resize=False, do_rescale=False, do_normalize=False, patch_size=14, temporal_patch_size=2, merge_size=2
    )
    theirs = processor(images=[frame.numpy()], return_tensors="pt", input_data_format="channels_first")
    assert theirs["image_grid_thw"].tolist() == grid.tolist() == [[1, 6, 6]]
    assert torch.equal(theirs["pixel_values"].float(), ours)


def run_example(rank: int, world_size: int, argv: list) -> dict:
    """The example's main on this process group, and the unmodified model's loss on the full batch."""
    example = _example()
    result = example.main(argv)
    args = example.parse_args(argv)
    batch = example.make_batch(args.frames, args.size)
    with torch.no_grad():
        result["unsharded"] = float(example.build_model()(**batch, use_cache=False).loss)
    return result


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_score_and_first_step_equal_the_unsharded_loss():
    result = run_distributed(run_example, 2, ["--frames", "8", "--size", "56", "--steps", "2"], timeout=300)[0]
    assert result["video_tokens"] == 16 and result["tokens"] == 46 + 16 + 2 + 47  # 4 temporal patches x 2 x 2
    assert abs(result["score"] - result["unsharded"]) < 1e-5 * result["unsharded"], result
    assert abs(result["losses"][0] - result["unsharded"]) < 1e-5 * result["unsharded"], result
    assert result["losses"][1] < result["losses"][0]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--size", "100"], "--size must be a positive multiple of 28 pixels; got 100"),
        (["--frames", "7"], "--frames must be a positive multiple of 2; got 7"),
    ],
)
def test_bad_arguments_exit_with_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _example().parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
