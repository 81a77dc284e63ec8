"""Callbacks that make loss scaling visible and stop runs that cannot recover.

* `LossScaleMonitor` puts `loss_scale`, `skipped_steps` and the epoch's `overflow_rate`
  into the logs (so the progress bar, `History` and `CSVLogger` show them) and can write
  them as TensorBoard scalars.
* `CollapseGuard` stops (or raises `LossScaleCollapseError`) when the loss scale is stuck
  at its floor or too many steps are skipped, naming the variables whose gradients were
  non-finite.
* `DivergenceGuard` (`keras_mp.observe.divergence`) stops a run whose loss climbs far above
  its best under any policy (a learning rate far too high), naming the learning rate;
  `CollapseGuard` runs the same check by default, and tells a learning-rate blow-up from a
  float16 range problem when the scale collapses.
* `NonFiniteGuard` (`keras_mp.observe.nonfinite_guard`) stops a run whose loss stays
  non-finite beyond what loss scaling can absorb, or whose weights went non-finite, and
  names the first layer whose output is non-finite (or the variables).

The callbacks read the optimizer's state variables only on the steps they check. On the
JAX backend they read them from the training loop's state (no full state sync), so there
is no host synchronisation on other steps.
"""

from __future__ import annotations

import logging
import os

import keras

from keras_mp.observe.backup import BackupAndRestore  # `kmp.callbacks.BackupAndRestore`
from keras_mp.observe.checkpoint import ModelCheckpoint  # `kmp.callbacks.ModelCheckpoint`
from keras_mp.observe.collapse_guard import CollapseGuard, LossScaleCollapseError
from keras_mp.observe.divergence import DivergenceError, DivergenceGuard
from keras_mp.observe.nonfinite_guard import NonFiniteGuard, recalibration_hint
from keras_mp.observe.telemetry import (
    ScalarWriter,
    StepCounter,
    Telemetry,
    choice,
    has_tensorboard,
    positive_int,
    unscaled_reason,
)

__all__ = [
    "BackupAndRestore",
    "CollapseGuard",
    "DivergenceError",
    "DivergenceGuard",
    "LossScaleCollapseError",
    "LossScaleMonitor",
    "ModelCheckpoint",
    "recalibration_hint",
    "NonFiniteGuard",
]

logger = logging.getLogger("keras_mp")


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleMonitor(keras.callbacks.Callback):
    """Adds the loss scale and skipped-step counts to the training logs.

    Every `every_n_steps` training steps the batch logs get `loss_scale` (the current
    scale) and `skipped_steps` (total steps skipped for non-finite gradients); at each
    epoch end the epoch logs get `loss_scale`, `skipped_steps` and `overflow_rate`
    (steps skipped in the epoch / steps in the epoch). Put it before other callbacks that
    read the logs; the progress bar and `History` always come after it. The per-step
    values are also kept in `self.history` (keys `step`, `loss_scale`, `skipped_steps`).

    Works with `kmp.LossScaleOptimizer` and with Keras' own `LossScaleOptimizer` (which
    has no skip counter: skips are then derived from its `iterations`, counted from the
    start of this `fit`). Under `"mixed_bfloat16"`, `"float32"` or `"float8"` compiled
    through keras_mp (a fixed scale of 1 that only skips non-finite steps) and under
    `"lean_bfloat16"` (`kmp.LeanOptimizer`'s own counter) it logs `skipped_steps` and
    `overflow_rate`, with no scale to log. A model whose optimizer neither scales nor
    skips (`auto_scale_loss=False`, no keras_mp policy) and that computes in no float16
    has nothing to watch: the monitor then adds nothing to the logs, says why once
    (`self.idle_reason`, and the `keras_mp` logger), and lets the run go on, so a callback
    list survives switching the policy. A float16 model without a `LossScaleOptimizer`
    is an error.

    Args:
        log_dir: optional directory for the scalars. `log_format="tensorboard"` writes
            TensorBoard events to `log_dir/train` (tags `loss_scale`, `skipped_steps` per
            logged step, `epoch_loss_scale`, `epoch_skipped_steps`,
            `epoch_overflow_rate` per epoch), next to those of `keras.callbacks.TensorBoard`
            with the same `log_dir`; it needs the `tensorflow` and `tensorboard` packages
            (any Keras backend; ImportError otherwise).
            `"csv"` appends rows `tag,step,value` to `log_dir/loss_scale.csv`. `"auto"`
            (default) uses TensorBoard when both packages are installed, else CSV (with a
            logged warning).
        every_n_steps: log every this many steps (other steps read nothing).
        log_format: `"auto"`, `"tensorboard"` or `"csv"`.

    Example:

    >>> opt = kmp.LossScaleOptimizer(keras.optimizers.Adam())
    >>> model.compile(optimizer=opt, loss="mse")  # doctest: +SKIP
    >>> monitor = kmp.callbacks.LossScaleMonitor(log_dir="logs")  # doctest: +SKIP
    >>> history = model.fit(x, y, callbacks=[monitor])  # doctest: +SKIP
    >>> history.history["loss_scale"]  # doctest: +SKIP
    """

    def __init__(
        self, log_dir: str | None = None, every_n_steps: int = 1, log_format: str = "auto"
    ):
        super().__init__()
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.every_n_steps = positive_int("LossScaleMonitor", "every_n_steps", every_n_steps)
        self.log_format = choice(
            "LossScaleMonitor", "log_format", log_format, ("auto", "tensorboard", "csv")
        )
        if self.log_dir is not None and log_format == "tensorboard" and not has_tensorboard():
            raise ImportError(
                "LossScaleMonitor(log_format='tensorboard') needs the `tensorflow` and "
                "`tensorboard` packages; install them or use log_format='csv'."
            )
        self.history: dict[str, list] = {"step": [], "loss_scale": [], "skipped_steps": []}
        self.idle_reason: str | None = None
        self._writer = None

    def on_train_begin(self, logs=None):
        self.idle_reason = unscaled_reason(self._model, "LossScaleMonitor")
        if self.idle_reason:
            return
        self._telemetry = Telemetry(self._model, "LossScaleMonitor")
        self._counter = StepCounter(self._telemetry)
        self._step0 = self._telemetry.applied() + (self._counter.skipped0 or 0)
        if self.log_dir is not None and self._writer is None:
            self._writer = ScalarWriter(self.log_dir, self.log_format)

    def on_epoch_begin(self, epoch, logs=None):
        if self.idle_reason:
            return
        self._counter.begin_epoch()
        self._epoch_skipped0 = self._counter.skipped()

    def on_train_batch_end(self, batch, logs=None):
        if self.idle_reason:
            return
        self._counter.end_batch(batch)
        step = self._counter.steps
        if step % self.every_n_steps:
            return
        scale, skipped = self._telemetry.scale(), self._counter.skipped()
        values = {"loss_scale": scale, "skipped_steps": skipped}
        if not self._telemetry.has_scale:
            del values["loss_scale"]  # a static 1 that only skips, or lean's none
        if logs is not None:
            logs.update(values)
        self.history["step"].append(step)
        for key, value in values.items():
            self.history[key].append(value)
        if self._writer is not None:
            self._writer.write(values, self._step0 + step)

    def on_epoch_end(self, epoch, logs=None):
        if self.idle_reason:
            return
        scale, skipped = self._telemetry.scale(), self._counter.skipped()
        steps = self._counter.epoch_steps
        rate = (skipped - self._epoch_skipped0) / steps if steps else 0.0
        values = {"loss_scale": scale, "skipped_steps": skipped, "overflow_rate": rate}
        if not self._telemetry.has_scale:
            del values["loss_scale"]
        if logs is not None:
            logs.update(values)
        if self._writer is not None:
            self._writer.write({f"epoch_{k}": v for k, v in values.items()}, epoch)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def get_config(self):
        return {
            "log_dir": self.log_dir,
            "every_n_steps": self.every_n_steps,
            "log_format": self.log_format,
        }
