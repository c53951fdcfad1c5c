"""``_aliases``: a tensor's storage span and layout rebuilt with the same strides, values and alignment,
against the tensor itself (what the activation offload relies on, Note [strides] in ``_saved``)."""

import pytest
import torch

from hybridsp.memory._aliases import ALIGNMENT_BYTES, empty_with, layout_of, same_elements, storage_span


def _views(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The views a user may hand a checkpointed layer: [2, 5, 3] each."""
    base = torch.arange(2 * 5 * 10, dtype=torch.float64).to(dtype)
    return {
        "contiguous": base[:30].view(2, 5, 3),  # [B, S, h]
        "transposed": base[:30].view(2, 3, 5).transpose(1, 2),  # [B, S, h]
        "sliced": base[:70].view(2, 5, 7)[..., 2:5],  # [B, S, h], gaps of 4
        "misaligned": base[1:31].view(2, 5, 3),  # [B, S, h], one element in
        "nine_in": base[9:39].view(2, 5, 3),  # [B, S, h], past a 64-byte boundary in fp64
        "sixty_four_in": base[64:94].view(2, 5, 3),  # [B, S, h], 64 elements in: aligned at 64, not at 256
        "expanded": base[:3].view(1, 1, 3).expand(2, 5, 3),  # [B, S, h], zero strides
        "empty": base[:0].view(2, 0, 3),  # [B, 0, h]
    }


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "name", ["contiguous", "transposed", "sliced", "misaligned", "nine_in", "sixty_four_in", "expanded", "empty"]
)
def test_a_span_copied_into_its_layout_is_the_same_tensor(name, dtype):
    saved = _views(dtype)[name]
    restored = empty_with(layout_of(saved), saved.dtype)
    storage_span(restored).copy_(storage_span(saved))
    assert restored.shape == saved.shape and restored.stride() == saved.stride()
    assert torch.equal(restored, saved)
    if saved.numel():
        assert restored.data_ptr() % ALIGNMENT_BYTES == saved.data_ptr() % ALIGNMENT_BYTES


def test_span_lengths_count_gaps_but_not_repeats():
    views = _views(torch.float32)
    assert storage_span(views["contiguous"]).numel() == storage_span(views["transposed"]).numel() == 30
    assert storage_span(views["sliced"]).numel() == 1 + 1 * 35 + 4 * 7 + 2 * 1  # gaps travel too
    assert storage_span(views["expanded"]).numel() == 3 and storage_span(views["empty"]).numel() == 0


def test_aliases_are_the_same_elements_the_same_way():
    tensor = torch.randn(4, 6)
    assert same_elements(tensor.detach(), tensor) and same_elements(tensor, tensor)
    assert not same_elements(tensor.t(), tensor) and not same_elements(tensor[1:], tensor)
    assert not same_elements(tensor.clone(), tensor) and not same_elements("tensor", tensor)


def test_a_storage_that_starts_unaligned_comes_back_at_the_same_address_alignment():
    """``frombuffer`` hands out a storage wherever the buffer is (here 8 bytes past a boundary)."""
    buffer = bytearray(8 * 40)
    saved = torch.frombuffer(buffer, dtype=torch.float64, offset=8 + (-_address(buffer)) % 64, count=24)
    saved.copy_(torch.arange(24, dtype=torch.float64))
    restored = empty_with(layout_of(saved), saved.dtype)
    storage_span(restored).copy_(storage_span(saved))
    assert torch.equal(restored, saved) and restored.data_ptr() % ALIGNMENT_BYTES == saved.data_ptr() % ALIGNMENT_BYTES


def _address(buffer: bytearray) -> int:
    return torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
