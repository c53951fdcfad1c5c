"""The ``"monitor"`` block under :class:`~hybridsp.integrations.transformers.HybridSPTrainer`: a ``TrainerCallback``.

Every optimizer step: :class:`hybridsp.monitor.RunMonitor`'s health metrics (``hybridsp/straggler_ratio``,
``hybridsp/straggler_rank``, ``hybridsp/imbalance``, ...), logged through ``Trainer.log`` on the logging
steps, so TensorBoard, W&B and ``log_history`` get them; every ``parity_every`` steps the exactness probe on
the first row of the step's first micro-batch (``hybridsp/parity_max_rel``; a failure raises
:class:`hybridsp.monitor.ParityError` naming layer and quantity, or warns).

Note [the anomaly policy under the Trainer]: ``"stop"`` judges the step's loss at its end and raises an
error naming the last checkpoint. ``"skip"`` and ``"rollback"`` judge the loss in ``compute_loss``, before
its backward (so ``gradient_accumulation_steps`` must be 1, as in ``examples/train.py``): a dropped step
runs no backward under DeepSpeed (whose engine steps inside the backward), and under DDP / FSDP2 a backward
of the loss times zero (the gradient reduction every rank expects) whose gradients are then set to None
before ``optimizer.step()``, which therefore changes neither the weights nor the optimizer state.
``"rollback"`` then reloads the last checkpoint's weights, optimizer and scheduler and goes on with the
next batch (the steps after that checkpoint are not replayed: the Trainer owns the data order). The
learning-rate schedule and ``global_step`` still advance over a dropped step. The guard's window travels in
each checkpoint (``hybridsp_monitor.json``), so a resumed run judges as the uninterrupted one would.
"""

from __future__ import annotations

import functools
import json
import os

from transformers import TrainerCallback

from hybridsp.monitor import MonitorConfig, RunMonitor

STATE_FILE = "hybridsp_monitor.json"  # in each Trainer checkpoint: the guard's window


class MonitorCallback(TrainerCallback):
    """Runs :class:`~hybridsp.monitor.RunMonitor` around each step of ``trainer`` (module docstring)."""

    def __init__(self, trainer, config: MonitorConfig) -> None:
        if config.on_anomaly != "stop" and trainer.args.gradient_accumulation_steps != 1:
            raise ValueError(
                f"monitor on_anomaly={config.on_anomaly!r} needs gradient_accumulation_steps 1 (got "
                f"{trainer.args.gradient_accumulation_steps}): the loss is judged before its backward; use "
                "on_anomaly='stop' or one micro-batch per step"
            )
        self.trainer, self.config = trainer, config
        self.monitor: RunMonitor | None = None
        self.batch: dict | None = None
        self.loss = 0.0
        self.dropping = False  # this step's update is dropped (skip or rollback)
        self.events: list[dict] = []
        self._saved_guard: dict | None = None  # a resumed run's guard, loaded when the monitor starts

    @property
    def judges_before_backward(self) -> bool:
        return self.config.on_anomaly != "stop"

    def remember(self, tensors: dict, loss) -> None:
        """Called by ``compute_loss`` per micro-batch: the first full batch of the step and the loss shares;
        under ``"skip"`` / ``"rollback"`` the step's loss is judged here (a collective over the replicas)."""
        if self.batch is None:
            self.batch = tensors
        self.loss += float(loss.detach())
        if self.judges_before_backward:
            self._judge_before_backward(self.loss)

    def _judge_before_backward(self, loss: float) -> None:
        step = self.trainer.state.global_step + 1
        verdict = self._started().admit(step, loss)
        if verdict.decision == "ok":
            return
        self.events.append({"step": step, "event": verdict.reason, "decision": verdict.decision})
        if verdict.decision == "stop":
            raise RuntimeError(
                f"step {step}: {verdict.reason}; the run stops (monitor on_anomaly). "
                f"Last checkpoint: {_last_checkpoint(self.trainer.args.output_dir)}"
            )
        self.dropping = True

    def _started(self) -> RunMonitor:
        if self.monitor is None:
            model = self.trainer.accelerator.unwrap_model(self.trainer.model)
            self.monitor = RunMonitor(model, self.trainer.hybrid_mesh, self.config)
            if self._saved_guard is not None:
                self.monitor.guard.load_state_dict(self._saved_guard)
        return self.monitor

    def on_step_begin(self, args, state, control, **kwargs):
        self.batch, self.loss, self.dropping = None, 0.0, False
        self._started().begin_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.dropping:
            if self.config.on_anomaly == "rollback":
                _reload(self.trainer, _last_checkpoint(args.output_dir, required=True))
            for parameter in self.trainer.model.parameters():  # optimizer.step() then changes nothing
                parameter.grad = None

    def on_step_end(self, args, state, control, **kwargs):
        monitor = self._started()
        judged = self.judges_before_backward
        metrics, verdict = monitor.end_step(
            state.global_step, self.loss if not self.dropping else 0.0, judge=not judged
        )
        if monitor.parity_due(state.global_step) and self.batch is not None and not self.dropping:
            metrics.update(monitor.probe(self.batch))
        if verdict.decision == "stop":
            raise RuntimeError(
                f"step {state.global_step}: {verdict.reason}; the run stops (monitor on_anomaly='stop'). "
                f"Last checkpoint: {_last_checkpoint(args.output_dir)}"
            )
        if self.dropping:
            metrics["hybridsp/dropped_step"] = 1.0
        if control.should_log:  # a row of its own; logging resets should_log, which the Trainer's loss row still needs
            self.trainer.log({k: v for k, v in metrics.items() if k != "hybridsp/loss"})
            control.should_log = True
        return control

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and self.monitor is not None and os.path.isdir(folder):
            with open(os.path.join(folder, STATE_FILE), "w") as handle:
                json.dump({"guard": self.monitor.guard.state_dict(), "events": self.events}, handle)
        return control

    def resume_from(self, checkpoint: str | bool | None) -> None:
        """Before ``train(resume_from_checkpoint=...)``: the checkpoint's guard window, if it holds one."""
        if checkpoint is True:
            checkpoint = _last_checkpoint(self.trainer.args.output_dir)
        path = os.path.join(str(checkpoint), STATE_FILE) if isinstance(checkpoint, str) else None
        if path is not None and os.path.isfile(path):
            with open(path) as handle:
                self._saved_guard = json.load(handle)["guard"]

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


def backward_unless_dropped(backward, callback: MonitorCallback, trainer, loss, **kwargs):
    """``accelerator.backward`` for ``"skip"`` / ``"rollback"`` (Note [the anomaly policy under the Trainer])."""
    if not callback.dropping:
        return backward(loss, **kwargs)
    if trainer.is_deepspeed_enabled:  # the engine steps inside its backward: none at all for a dropped step
        return None
    return backward(loss * 0.0, **kwargs)  # DDP / FSDP2 reduce as every rank expects; the gradients are dropped


def _reload(trainer, checkpoint: str) -> None:
    """The checkpoint's weights, optimizer and scheduler into the running trainer (``"rollback"``)."""
    if trainer.is_deepspeed_enabled:
        from transformers.integrations.deepspeed import deepspeed_load_checkpoint

        deepspeed_load_checkpoint(trainer.model_wrapped, checkpoint)
        return
    trainer._load_from_checkpoint(checkpoint)
    trainer._load_optimizer_and_scheduler(checkpoint)


def _last_checkpoint(output_dir: str, required: bool = False) -> str:
    from transformers.trainer_utils import get_last_checkpoint

    found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if found is None and required:
        raise RuntimeError("monitor on_anomaly='rollback' found no checkpoint to go back to: set save_steps")
    return found or "none saved yet"


def monitor_callback(trainer, block) -> MonitorCallback | None:
    """The callback for the section's ``"monitor"`` block, added to ``trainer`` (None, and nothing added, without
    one); under ``"skip"`` / ``"rollback"`` the trainer's ``accelerator.backward`` drops a judged step."""
    if block is None:
        return None
    callback = MonitorCallback(trainer, MonitorConfig.from_dict(block))
    trainer.add_callback(callback)
    if callback.judges_before_backward:
        trainer.accelerator.backward = functools.partial(
            backward_unless_dropped, trainer.accelerator.backward, callback, trainer
        )
    return callback
