"""The ``"monitor"`` block under :class:`~hybridsp.integrations.transformers.HybridSPTrainer`: a ``TrainerCallback``.

Every optimizer step: :class:`hybridsp.monitor.RunMonitor`'s health metrics (``hybridsp/straggler_ratio``,
``hybridsp/straggler_rank``, ``hybridsp/imbalance``, ...), logged through ``Trainer.log`` on the logging
steps, so TensorBoard, W&B and ``log_history`` get them; every ``parity_every`` steps the exactness probe on
the first row of the step's first micro-batch (``hybridsp/parity_max_rel``; a failure raises
:class:`hybridsp.monitor.ParityError` naming layer and quantity, or warns). A non-finite loss or a spike
stops the run with an error naming the last checkpoint (``on_anomaly="stop"``). ``"skip"`` and
``"rollback"`` need the step's loss before the update, which the Trainer does not hand a callback: they run
in loops that own the step (``examples/train.py``), and are refused here.
"""

from __future__ import annotations

import os

from transformers import TrainerCallback

from hybridsp.monitor import MonitorConfig, RunMonitor


class MonitorCallback(TrainerCallback):
    """Runs :class:`~hybridsp.monitor.RunMonitor` around each step of ``trainer`` (module docstring)."""

    def __init__(self, trainer, config: MonitorConfig) -> None:
        if config.on_anomaly != "stop":
            raise ValueError(
                f"HybridSPTrainer's monitor takes on_anomaly='stop' only (got {config.on_anomaly!r}): 'skip' and "
                f"'rollback' need the loss before the update; use them in a loop that owns the step (examples/train.py)"
            )
        self.trainer, self.config = trainer, config
        self.monitor: RunMonitor | None = None
        self.batch: dict | None = None
        self.loss = 0.0

    def remember(self, tensors: dict, loss) -> None:
        """Called by ``compute_loss`` per micro-batch: the first full batch of the step and the loss shares."""
        if self.batch is None:
            self.batch = tensors
        self.loss += float(loss.detach())

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is None:
            model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            self.monitor = RunMonitor(model, self.trainer.hybrid_mesh, self.config)
        self.batch, self.loss = None, 0.0
        self.monitor.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        assert self.monitor is not None
        metrics, verdict = self.monitor.end_step(state.global_step, self.loss)
        if self.monitor.parity_due(state.global_step) and self.batch is not None:
            metrics.update(self.monitor.probe(self.batch))
        if verdict.decision == "stop":
            raise RuntimeError(
                f"step {state.global_step}: {verdict.reason}; the run stops (monitor on_anomaly='stop'). "
                f"Last checkpoint: {_last_checkpoint(args.output_dir)}"
            )
        if control.should_log:  # a row of its own; logging resets should_log, which the Trainer's loss row still needs
            self.trainer.log({k: v for k, v in metrics.items() if k != "hybridsp/loss"})
            control.should_log = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


def _last_checkpoint(output_dir: str) -> str:
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    return found or "none saved yet"


def monitor_callback(trainer, block) -> MonitorCallback | None:
    """The callback for the section's ``"monitor"`` block, added to ``trainer`` (None, and nothing added, without one)."""
    if block is None:
        return None
    callback = MonitorCallback(trainer, MonitorConfig.from_dict(block))
    trainer.add_callback(callback)
    return callback
