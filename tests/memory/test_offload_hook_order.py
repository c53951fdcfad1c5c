"""Activation offload finds the checkpointed layers' inputs whichever way the checkpoint wraps a layer.

transformers before 5.25 checkpoint a layer's ``__call__`` (the layer's forward hooks run inside the
checkpointed region, after the checkpoint saved the input); 5.25 and later checkpoint ``forward`` (the
hooks run first). Both are built here from plain modules and ``torch.utils.checkpoint`` (non-reentrant
and reentrant), with ``layers=`` given: every layer input but the newest goes to host, and the loss and
gradients equal plain checkpointing bitwise (single process, fp32 and fp64, B = 2).
"""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridsp import offload_activations

LAYERS, BATCH, SEQ, HIDDEN = 4, 2, 16, 32


class _Block(nn.Module):
    def __init__(self, wraps: str, reentrant: bool):
        super().__init__()
        self.proj, self.wraps, self.reentrant = nn.Linear(HIDDEN, HIDDEN), wraps, reentrant

    def forward(self, hidden):
        if self.wraps == "forward" and self.training:
            return checkpoint(self._body, hidden, use_reentrant=self.reentrant)
        return self._body(hidden)

    def _body(self, hidden):
        return hidden + torch.tanh(self.proj(hidden))

    def __call__(self, *args, **kwargs):
        if self.wraps == "call" and self.training:  # the hooks of super().__call__ run inside the checkpoint
            return checkpoint(super().__call__, *args, use_reentrant=self.reentrant, **kwargs)
        return super().__call__(*args, **kwargs)


def _model(wraps: str, reentrant: bool, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(wraps, reentrant) for _ in range(LAYERS))).to(dtype).train()


def _step(model: nn.Module, batch: torch.Tensor, offload=None):
    model.zero_grad(set_to_none=True)
    inputs = batch.clone().requires_grad_()
    if offload is None:
        loss = model(inputs).square().mean()
    else:
        with offload:
            loss = model(inputs).square().mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()] + [inputs.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("wraps", ["call", "forward"])
def test_every_layer_input_but_the_newest_goes_to_host(wraps, reentrant, dtype):
    model = _model(wraps, reentrant, dtype)
    batch = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    plain_loss, plain_grads = _step(model, batch)
    hosted = []

    def host(shape, dtype):
        hosted.append(torch.empty(shape, dtype=dtype))
        return hosted[-1]

    offload = offload_activations(model, layers=list(model), min_bytes=0, host_allocator=host)
    loss, grads = _step(model, batch, offload)
    assert offload.stats.offloaded_tensors == LAYERS - 1
    assert offload.stats.offloaded_bytes == (LAYERS - 1) * BATCH * SEQ * HIDDEN * batch.element_size()
    assert offload.stats.restored_tensors == LAYERS - 1
    assert len(hosted) == LAYERS - 1
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    offload.remove()
