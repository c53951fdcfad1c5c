"""The offload's per-input handle (``_saved.SavedInput``) in the states only CUDA reaches, driven on CPU
with stand-ins: a side-stream copy still running (an event not yet reached) and a staging copy that
fails after its write took a slot (Note [in-place changes], Note [disk] in ``_saved``)."""

import pytest
import torch
from torch import nn

from hybridsp import offload_activations
from hybridsp.memory._aliases import storage_span
from hybridsp.memory._saved import SavedInput


class _CopyEvent:
    """Stands in for the CUDA event recorded after the side-stream copy: ``query`` says whether it is done."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _copy_in_flight(offload, tensor: torch.Tensor) -> tuple[SavedInput, _CopyEvent]:
    """A handle as CUDA's offload leaves it: the host copy made, the device tensor held until the copy's
    event is reached."""
    handle, event = SavedInput(offload, tensor), _CopyEvent()
    handle.host, handle.event, handle.copying = storage_span(tensor).clone(), event, tensor  # [n]
    handle.device_tensor = None
    offload._copying.append(handle)
    return handle, event


def _offload(**options):
    return offload_activations(None, layers=[nn.Linear(4, 4)], min_bytes=0, **options)


def test_a_copy_not_yet_done_holds_the_device_tensor_until_its_event():
    offload, tensor = _offload(), torch.randn(3, 4)
    handle, event = _copy_in_flight(offload, tensor)
    offload._settle_copies()
    assert handle.copying is tensor and offload._copying == [handle]
    event.done = True
    offload._settle_copies()
    assert handle.copying is None and offload._copying == [] and not handle.changed
    assert torch.equal(handle.restore(), tensor)


@pytest.mark.parametrize("waited", [False, True])
def test_an_in_place_change_while_the_copy_runs_raises_in_the_backward(waited):
    """The change is launched before the copy is seen done: the copy may be torn, so the restore raises
    (as plain checkpointing does); polled (``waited=False``) or waited for by the restore itself."""
    offload, tensor = _offload(), torch.randn(3, 4)
    handle, event = _copy_in_flight(offload, tensor)
    tensor.mul_(2)
    if not waited:
        event.done = True
        offload._settle_copies()
        assert handle.changed
    with pytest.raises(RuntimeError, match="modified in place"):
        handle.restore()


def test_a_change_after_the_copy_is_done_does_no_harm():
    offload, tensor = _offload(), torch.randn(3, 4)
    handle, event = _copy_in_flight(offload, tensor)
    saved = tensor.clone()
    event.done = True
    offload._settle_copies()
    tensor.mul_(2)
    assert torch.equal(handle.restore(), saved)


def test_a_staging_copy_that_fails_gives_its_slot_back_and_counts_nothing(tmp_path):
    def refuse(shape, dtype):
        raise MemoryError("no pinned memory left")

    offload, tensor = _offload(spill_dir=tmp_path, host_allocator=refuse), torch.randn(3, 4)
    offload.stream = object()  # the staging path, which CPU's disk tier never takes; fails before the stream
    handle = SavedInput(offload, tensor)
    with pytest.raises(MemoryError):
        handle.offload()
    assert offload.disk is not None and offload.disk._in_flight == 0
    assert handle.device_tensor is tensor and offload.stats.offloaded_tensors == offload.stats.spilled_bytes == 0
    offload.remove()


def test_the_forward_s_end_waits_for_the_copies_so_nothing_is_held_past_it():
    """A step that stops (an error, or no backward) leaves no device input or graph on the offload."""
    offload, tensor = _offload(), torch.randn(3, 4)
    with offload:
        handle, event = _copy_in_flight(offload, tensor)
    assert event.done and handle.copying is None and offload._copying == [] and not handle.changed
