"""``hybridsp.verify_parity(model, mesh, batch)``: the exactness probe on the user's own model and batch.

Note [probe tap]: the probe must see each attention layer's q/k/v exactly as the switched call got
them, without a second code path. :func:`hybridsp.integrations.transformers.apply` binds a small
``Binding`` to every attention module; for one pass the probe replaces it by a copy whose ``tap`` is a
recorder (and puts the old one back after, whatever happens), and the switched call hands the tap its
q/k/v, its output and its settings. Nothing global changes, and a model that is not being probed
runs the same code as before plus one ``is None`` test per call.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from hybridsp.mesh._hybrid_mesh import HybridMesh
from hybridsp.monitor._compare import compare_pass
from hybridsp.monitor._report import ParityReport


def verify_parity(
    model: nn.Module,
    mesh: HybridMesh,
    batch: Mapping[str, Any],
    *,
    factor: float = 2.0,
    rtol: float | None = None,
    pad_token_id: int = 0,
) -> ParityReport:
    """Check one sharded forward and backward of ``model`` against plain float64 attention math.

    Runs ``model`` on this rank's shard of ``batch`` with every attention call recorded, takes the
    gradients of :func:`hybridsp.sharded_cross_entropy` with respect to each layer's q/k/v and output
    (``torch.autograd.grad``: no parameter's ``.grad`` changes), and compares per layer the output
    and the q/k/v gradients with attention computed in float64 on the gathered q/k/v (masks from the
    positions the model was fed), and the loss and the logits' gradient with a float64 cross-entropy.

    Args:
        model: a transformers causal LM switched with :func:`hybridsp.integrations.transformers.apply`
            over ``mesh`` (the engine's module under DeepSpeed).
        mesh: the :class:`~hybridsp.mesh._hybrid_mesh.HybridMesh` it is switched over.
        batch: the full (unsharded) batch every context rank holds: ``input_ids`` and ``labels``
            [B, S], optional ``attention_mask`` / ``position_ids`` (as :func:`hybridsp.shard_batch`).
        factor, rtol: the tolerance (Note [parity tolerance] in :mod:`hybridsp.monitor._report`):
            ``factor`` times the same-dtype single-device error plus a floor per dtype, or ``rtol``.
        pad_token_id: what pads ``input_ids`` to the layout's multiple.

    Returns:
        a :class:`~hybridsp.monitor.ParityReport`, the same on every rank: ``ok``, ``worst`` (layer,
        quantity, relative error, tolerance, rank), ``rows`` (one per attention layer), ``loss``,
        ``table()``. A collective: every rank of the mesh must call it with its replica's batch.
    """
    from hybridsp.integrations.transformers._probe_pass import probe_pass

    if factor <= 0 or (rtol is not None and rtol <= 0):
        raise ValueError(f"verify_parity needs factor > 0 and rtol > 0 (or None); got factor={factor}, rtol={rtol}")
    record = probe_pass(model, mesh, batch, pad_token_id=pad_token_id)
    return compare_pass(record, mesh, factor=factor, rtol=rtol)
