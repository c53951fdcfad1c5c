"""ZeRO-3 partitioned parameters for code that uses them outside a module call: gathered for a
block, and given their full gradient the way a module's backward does. Reached through
:mod:`hybridsp.memory._sharded_params`, which picks the engine by the marker DeepSpeed puts on
its parameters (``ds_id``).

## Gathering
Gather ZeRO-3 partitioned parameters for a block, the DeepSpeed way; a no-op for anything else.

ZeRO-3 keeps each rank's slice of a parameter in ``param.ds_tensor`` and an empty ``param.data``
between uses; ``deepspeed.zero.GatheredParameters`` all-gathers the full tensors for a block and
partitions them again at its end. Parameters that are already available (gathered by their
module's own DeepSpeed hooks) or that are not ZeRO-3 parameters at all are left alone, so code
that calls :func:`gathered` runs unchanged without DeepSpeed (which is imported only when a
ZeRO-3 parameter is seen).

## Gradient landing
Hand a full gradient to a ZeRO-3 partitioned parameter the way a module's backward does.

Under ZeRO-3 a parameter's ``data`` is an empty placeholder between uses and its full values
live in shards (``param.ds_tensor``). DeepSpeed reduces gradients from a hook that runs right
after the parameter's ``AccumulateGrad`` node (``register_post_accumulate_grad_hook``): it copies
the full ``param.grad`` into its bucket, reduce-scatters and keeps this rank's shard. For a
module call the parameter is gathered again by the module's pre-backward hook, so when the
gradient lands ``param.data`` has its full shape (autograd's accumulation needs the parameter
and the gradient to agree in shape) and is released by the post-backward hook.

A function that uses the weight outside any module (``hybridsp.fused_cross_entropy`` called
directly on ``lm_head.weight``) has no such hooks: its gradient would land on an empty
parameter and fail. :func:`land_full_gradient` adds the two missing steps on the parameter's
own ``AccumulateGrad`` node, for the next time it runs:

    before   if the parameter is partitioned (``ds_status`` NOT_AVAILABLE), its ``data`` becomes an
             uninitialised tensor of the full shape ``ds_shape`` (only the shape is needed: the
             gradient was already computed, so no all-gather is spent on values nobody reads)
    (autograd accumulates; DeepSpeed's own hook reduces the gradient exactly once: a tied
     embedding's contributions are summed by autograd first, as for any shared parameter)
    after    the placeholder is dropped and the partitioned ``data`` put back.

If the parameter is available when its gradient lands (a tied embedding whose module's
backward has gathered it, or a persistent small parameter), nothing is changed. The hooks fire
once and remove themselves. Without DeepSpeed (no ``ds_id``) this is a no-op.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch


def gathered(params: Iterable[torch.Tensor]):
    """A context manager in which every ZeRO-3 parameter of ``params`` holds its full data.

    One all-gather for all of them (a collective over the parameters' partition group: every
    rank of it must enter the block the same number of times, in the same order).
    """
    pending = [p for p in params if hasattr(p, "ds_id")]
    if not pending:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    # ds_status: a ZeRO-3 parameter's dynamic attribute
    pending = [p for p in pending if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]  # type: ignore[attr-defined]
    if not pending:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(pending, modifier_rank=None)


def land_full_gradient(output: torch.Tensor, input_index: int, param: torch.Tensor) -> None:
    """Arm ``param``'s gradient landing (module docstring) for the next backward through ``output``.

    Args:
        output: a tensor whose ``grad_fn`` took ``param`` as its input number ``input_index``.
        input_index: the position of ``param`` among that function's inputs.
        param: a leaf parameter, possibly a ZeRO-3 parameter (``ds_id``, ``ds_status``, ``ds_shape``).
    """
    if not hasattr(param, "ds_id") or not param.requires_grad or output.grad_fn is None:
        return
    node = output.grad_fn.next_functions[input_index][0]
    if node is None or type(node).__name__ != "AccumulateGrad" or node.variable is not param:  # type: ignore[attr-defined]  # AccumulateGrad's; not in torch's Node stub
        raise RuntimeError(
            f"input {input_index} of {output.grad_fn.name()} is not the parameter's gradient "
            f"accumulator ({type(node).__name__}); cannot arm the ZeRO-3 gradient landing"
        )
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    state: dict[str, torch.Tensor] = {}

    def before(grad_inputs):
        before_handle.remove()
        if param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.data.numel() != param.ds_numel:
            state["partitioned"] = param.data
            param.data = torch.empty(tuple(param.ds_shape), dtype=param.dtype, device=param.device)  # [V, h]
        return None

    def after(grad_inputs, grad_outputs):
        after_handle.remove()
        if "partitioned" in state:
            param.data = state.pop("partitioned")
        return None

    before_handle = node.register_prehook(before)
    after_handle = node.register_hook(after)
