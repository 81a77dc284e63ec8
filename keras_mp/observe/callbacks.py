"""Callbacks that make loss scaling visible and stop runs that cannot recover.

* `LossScaleMonitor` puts `loss_scale`, `skipped_steps` and the epoch's `overflow_rate`
  into the logs (so the progress bar, `History` and `CSVLogger` show them) and can write
  them as TensorBoard scalars.
* `CollapseGuard` stops (or raises `LossScaleCollapseError`) when the loss scale is stuck
  at its floor or too many steps are skipped, naming the variables whose gradients were
  non-finite.
* `NonFiniteGuard` stops a run whose loss stays non-finite beyond what loss scaling can
  absorb and names the first layer whose output is non-finite.

The callbacks read the optimizer's state variables only on the steps they check. On the
JAX backend they read them from the training loop's state (no full state sync), so there
is no host synchronisation on other steps.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from typing import Any

import keras
import numpy as np

from keras_mp.conversion.probe import first_nonfinite_layer
from keras_mp.observe.checkpoint import ModelCheckpoint  # `kmp.callbacks.ModelCheckpoint`
from keras_mp.observe.telemetry import (
    ScalarWriter,
    StepCounter,
    Telemetry,
    choice,
    counting_optimizer,
    has_tensorboard,
    nonfinite_weights,
    positive_int,
    unscaled_reason,
)

__all__ = [
    "CollapseGuard",
    "LossScaleCollapseError",
    "LossScaleMonitor",
    "ModelCheckpoint",
    "recalibration_hint",
    "NonFiniteGuard",
]

logger = logging.getLogger("keras_mp")


class LossScaleCollapseError(RuntimeError):
    """Raised by `CollapseGuard(action="raise")` when loss scaling can no longer help."""


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
    start of this `fit`). A model that trains without loss scaling and computes in no
    float16 (`"mixed_bfloat16"`, `"float32"`, `"float8"`) has no scale to watch: the
    monitor then adds nothing to the logs, says why once (`self.idle_reason`, and the
    `keras_mp` logger), and lets the run go on, so a callback list survives switching the
    policy. A float16 model without a `LossScaleOptimizer` is an error.

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
        if logs is not None:
            logs["loss_scale"] = scale
            logs["skipped_steps"] = skipped
        self.history["step"].append(step)
        self.history["loss_scale"].append(scale)
        self.history["skipped_steps"].append(skipped)
        if self._writer is not None:
            self._writer.write({"loss_scale": scale, "skipped_steps": skipped}, self._step0 + step)

    def on_epoch_end(self, epoch, logs=None):
        if self.idle_reason:
            return
        scale, skipped = self._telemetry.scale(), self._counter.skipped()
        steps = self._counter.epoch_steps
        rate = (skipped - self._epoch_skipped0) / steps if steps else 0.0
        values = {"loss_scale": scale, "skipped_steps": skipped, "overflow_rate": rate}
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


# -- CollapseGuard ------------------------------------------------------------------------

_COLLAPSE_HINT = (
    "The gradients stay non-finite however far the scale backs off, so loss scaling cannot "
    "fix them: look at the layers of the named variables (an op with an infinite derivative, "
    "such as sqrt or log at 0, or activations above the float16 maximum: run "
    "`kmp.audit(model, (x, y))`), pin them to float32 (`kmp.layers.Float32`), or train with "
    "'mixed_bfloat16'."
)


def recalibration_hint(model, data, margin: float = 4.0) -> str:
    """What calibrating on `data` would pin beyond the model's current float32 layers.

    The model's float32 form is measured on `data` (a copy: `kmp.convert(model,
    "float32")`); layers that pass float16's max / margin and run low now are named.

    Returns:
        A sentence, or "" when the model does not compute in float16 or nothing new is found.
    """
    from keras_mp.conversion.calibration import measure, range_pins
    from keras_mp.conversion.converter import convert

    layers = [x for x in model._flatten_layers(include_self=False)]
    if not any(x.compute_dtype == "float16" for x in layers):
        return ""
    try:
        pins = range_pins(measure(convert(model, "float32"), data), "float16", margin)
    except Exception:  # noqa: BLE001 - a diagnosis must not fail the run
        return ""
    low = {a for a, x in _addresses(model).items() if x.compute_dtype == "float16"}
    new = [f"{a!r} ({reason.split(': ', 1)[-1]})" for a, reason in pins.items() if a in low]
    if not new:
        return ""
    return (
        f"On these batches, {len(new)} layer(s) running in float16 pass its range in float32: "
        f"{', '.join(new[:4])}{' ...' if len(new) > 4 else ''}. Convert the float32 model "
        "again with these batches among the calibration data: "
        "kmp.convert(model, 'mixed_float16', calibrate=[..., batch])."
    )


def _addresses(model) -> dict:
    from keras_mp.keep_list.tree import addresses, layer_tree

    layers, _ = layer_tree(model)
    where = addresses(model)
    return {where[id(x)]: x for x in layers}


_FIX_HINT = (
    "Loss scaling cannot fix non-finite values produced in the forward pass or by the loss: "
    "run `kmp.audit(model, (x, y))` to find activations above the float16 maximum, pin those "
    "layers to float32 (`kmp.layers.Float32`, or `keep_fp32` in `kmp.Policy`), or train "
    "with 'mixed_bfloat16', which has the range of float32."
)


@keras.saving.register_keras_serializable(package="keras_mp")
class CollapseGuard(keras.callbacks.Callback):
    """Stops training when loss scaling has collapsed.

    Every `check_every` steps it reads the scale and the skip counter. It fires when
      * the scale has been at or below its floor (`min_scale`, by default the
        optimizer's own `min_scale`; 1.0 for Keras' `LossScaleOptimizer`) for
        `patience` consecutive checks, or
      * more than `max_skip_rate` of the last `window` steps were skipped.

    Firing sets `model.stop_training = True` and logs the diagnosis (`action="stop"`), or
    raises `LossScaleCollapseError` (`action="raise"`). The diagnosis, also kept in
    `self.diagnosis` (with the step in `self.stopped_step`), says what happened and
    names the variables whose gradients were non-finite in the last overflow. A model
    that trains without loss scaling and computes in no float16 (`"mixed_bfloat16"`,
    `"float32"`) has no scale to collapse: the guard then does nothing and says why once
    (`self.idle_reason`); use `NonFiniteGuard` to stop such a run on a non-finite loss.

    Args:
        patience: consecutive checks at the floor before firing.
        min_scale: the floor; `None` uses the optimizer's `min_scale`.
        max_skip_rate: fire when the fraction of skipped steps over the last `window`
            steps exceeds this, in (0, 1].
        window: steps over which the skip rate is measured (it is judged once that many
            steps have run in this `fit`).
        action: `"stop"` or `"raise"`.
        check_every: read the optimizer every this many steps.

    Example:

    >>> guard = kmp.callbacks.CollapseGuard(patience=10, action="raise")
    >>> model.fit(x, y, callbacks=[guard])  # doctest: +SKIP
    """

    def __init__(
        self,
        patience: int = 10,
        min_scale: float | None = None,
        max_skip_rate: float = 0.5,
        window: int = 100,
        action: str = "stop",
        check_every: int = 1,
    ):
        super().__init__()
        self.patience = positive_int("CollapseGuard", "patience", patience)
        if min_scale is not None and (
            isinstance(min_scale, bool)
            or not isinstance(min_scale, (int, float))
            or not 0 < min_scale < math.inf
        ):
            raise ValueError(
                f"CollapseGuard: `min_scale` must be None or a finite number > 0, "
                f"got {min_scale!r}."
            )
        self.min_scale = min_scale
        if (
            isinstance(max_skip_rate, bool)
            or not isinstance(max_skip_rate, (int, float))
            or not (0 < max_skip_rate <= 1)
        ):
            raise ValueError(
                f"CollapseGuard: `max_skip_rate` must be a number in (0, 1], got {max_skip_rate!r}."
            )
        self.max_skip_rate = float(max_skip_rate)
        self.window = positive_int("CollapseGuard", "window", window)
        self.action = choice("CollapseGuard", "action", action, ("stop", "raise"))
        self.check_every = positive_int("CollapseGuard", "check_every", check_every)
        self.diagnosis: str | None = None
        self.stopped_step: int | None = None
        self.idle_reason: str | None = None

    def on_train_begin(self, logs=None):
        self.diagnosis = None
        self.stopped_step = None
        self.idle_reason = unscaled_reason(self._model, "CollapseGuard")
        if self.idle_reason:
            return
        self._telemetry = Telemetry(self._model, "CollapseGuard")
        self._counter = StepCounter(self._telemetry)
        self._floor = self.min_scale if self.min_scale is not None else self._telemetry.min_scale
        self._at_floor = 0
        self._checks: deque = deque([(0, self._counter.skipped())])
        self.diagnosis = None
        self.stopped_step = None

    def on_epoch_begin(self, epoch, logs=None):
        if self.idle_reason:
            return
        self._counter.begin_epoch()

    def on_train_batch_end(self, batch, logs=None):
        if self.idle_reason:
            return
        self._counter.end_batch(batch)
        step = self._counter.steps
        if step % self.check_every:
            return
        scale, skipped = self._telemetry.scale(), self._counter.skipped()
        at_floor = self._telemetry.dynamic and scale <= self._floor * (1 + 1e-6)
        self._at_floor = self._at_floor + 1 if at_floor else 0
        checks = self._checks
        checks.append((step, skipped))
        while len(checks) > 2 and step - checks[1][0] >= self.window:
            checks.popleft()
        span = step - checks[0][0]
        rate = (skipped - checks[0][1]) / span if span else 0.0
        if self._at_floor >= self.patience:
            what = (
                f"the loss scale has been at its floor ({scale:g} <= {self._floor:g}) for "
                f"{self._at_floor} consecutive checks"
            )
        elif span >= self.window and rate > self.max_skip_rate:
            what = (
                f"{rate:.0%} of the last {span} steps were skipped for non-finite gradients "
                f"(max_skip_rate={self.max_skip_rate:g}; loss scale now {scale:g})"
            )
        else:
            return
        self._fire(what, step, skipped)

    def _fire(self, what: str, step: int, skipped: int):
        opt = self.model.optimizer  # `self.model` syncs the JAX state once, here.
        if hasattr(opt, "nonfinite_variable_names"):
            names = opt.nonfinite_variable_names()
            culprits = (
                "Gradients were non-finite in the last overflow for: " + ", ".join(names) + "."
                if names
                else "No variable is recorded with a non-finite gradient."
            )
        else:
            culprits = "(Keras' LossScaleOptimizer does not record which gradients overflowed.)"
        self.stopped_step = step
        self.diagnosis = (
            f"Loss-scale collapse at step {step}: {what}; {skipped} step(s) skipped in total. "
            f"{culprits} {_COLLAPSE_HINT}"
        )
        if self.action == "raise":
            raise LossScaleCollapseError(self.diagnosis)
        logger.warning("CollapseGuard stops training. %s", self.diagnosis)
        self.model.stop_training = True

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def get_config(self):
        return {
            "patience": self.patience,
            "min_scale": self.min_scale,
            "max_skip_rate": self.max_skip_rate,
            "window": self.window,
            "action": self.action,
            "check_every": self.check_every,
        }


# -- NonFiniteGuard -----------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="keras_mp")
class NonFiniteGuard(keras.callbacks.Callback):
    """Stops a run whose loss stays non-finite and names the layer that overflows.

    A step counts as bad when the running loss in the batch logs is non-finite and,
    with a `LossScaleOptimizer`, the step was skipped (so the scaler did not absorb it).
    The guard fires after `patience` consecutive bad steps, or at once when a bad step
    happens with the scale already at its floor (it cannot back off further).

    It also checks the weights themselves (at each epoch's end, and every
    `check_weights_every` steps when set): a non-finite step that reached them (an
    optimizer that does not skip: stock Keras, `auto_scale_loss=False`, a custom loop)
    leaves the loss finite where ReLU maps NaN to 0, yet every later step is wasted. The
    guard then fires at once, naming the variables.

    Keras does not hand the training batch to callbacks, so the diagnosis runs the model
    layer by layer on `diagnose_data` (a batch `x` or `(x, y)` you supply, e.g. the first
    training batch) and names the first layer, in execution order, whose output is
    non-finite (for float16 layers: above 65504). Without `diagnose_data`, or for a
    subclassed model, the diagnosis says so. It is kept in `self.diagnosis` (the layer
    name in `self.culprit`, the step in `self.stopped_step`).

    Args:
        patience: consecutive bad steps before firing.
        diagnose_data: `x` or `(x, y)` used to locate the overflowing layer.
        action: `"stop"` (set `model.stop_training` and log) or `"raise"`
            (`FloatingPointError`).
        check_weights_every: also check the weights every this many steps (one
            finiteness reduction per variable and one small transfer); None (default):
            at each epoch's end only.

    Example:

    >>> guard = kmp.callbacks.NonFiniteGuard(patience=3, diagnose_data=x[:64])
    >>> model.fit(x, y, callbacks=[guard])  # doctest: +SKIP
    >>> guard.culprit  # doctest: +SKIP
    'dense_1'
    """

    def __init__(
        self,
        patience: int = 3,
        diagnose_data: Any = None,
        action: str = "stop",
        check_weights_every: int | None = None,
    ):
        super().__init__()
        self.patience = positive_int("NonFiniteGuard", "patience", patience)
        self.diagnose_data = diagnose_data
        self.action = choice("NonFiniteGuard", "action", action, ("stop", "raise"))
        self.check_weights_every = (
            None
            if check_weights_every is None
            else positive_int("NonFiniteGuard", "check_weights_every", check_weights_every)
        )
        self.diagnosis: str | None = None
        self.culprit: str | None = None
        self.stopped_step: int | None = None

    def on_train_begin(self, logs=None):
        opt = counting_optimizer(self._model)
        self._telemetry = None if opt is None else Telemetry(self._model, "NonFiniteGuard")
        self._steps = 0
        self._bad = 0
        self._skipped_seen = 0
        if self._telemetry is not None and self._telemetry.has_counter:
            self._skipped_seen = self._telemetry.skipped()
        self.diagnosis = self.culprit = self.stopped_step = None

    def _this_step_skipped(self) -> bool:
        t = self._telemetry
        if t is None or not t.has_counter:
            return True  # a non-finite loss gives non-finite gradients: the step is skipped
        if t.lean:  # a counter only: did it move since the last look?
            skipped = t.skipped()
            moved, self._skipped_seen = skipped > self._skipped_seen, skipped
            return moved
        last = int(t.reader.read(t.optimizer.last_overflow_step))
        return last == t.applied() + t.skipped() - 1

    def _check_weights(self) -> bool:
        bad = nonfinite_weights(self._model)
        if bad:
            self._fire(
                f"{len(bad)} weight variable(s) hold inf or NaN ({', '.join(bad[:5])}"
                + (", ..." if len(bad) > 5 else "")
                + ")",
                what="Non-finite weights",
            )
        return bool(bad)

    def on_epoch_end(self, epoch, logs=None):
        if self.stopped_step is None:
            self._check_weights()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        every = self.check_weights_every
        if every and self._steps % every == 0 and self._check_weights():
            return
        loss = (logs or {}).get("loss")
        # The logged loss is the epoch's running mean: once non-finite it stays so for the
        # epoch, so with a loss scaler a step only counts when it was itself skipped.
        if loss is None or math.isfinite(loss) or not self._this_step_skipped():
            self._bad = 0
            return
        self._bad += 1
        t = self._telemetry
        at_floor = t is not None and t.dynamic and t.scale() <= t.min_scale * (1 + 1e-6)
        if self._bad >= self.patience or at_floor:
            why = f"the loss has been non-finite for {self._bad} consecutive step(s)" + (
                " with the loss scale at its floor" if at_floor else ""
            )
            self._fire(why)

    def _fire(self, why: str, what: str = "Non-finite loss"):
        model = self.model  # syncs the JAX state so the diagnosis sees the current weights
        self.stopped_step = self._steps
        corrupted = [
            v.path
            for v in model.trainable_variables
            if not np.all(np.isfinite(keras.ops.convert_to_numpy(v.value)))
        ]
        if corrupted:
            where = (
                f"The weights are already non-finite ({', '.join(corrupted[:5])}"
                + (", ..." if len(corrupted) > 5 else "")
                + "): the optimizer applied a non-finite step, so the overflowing layer can "
                "no longer be located. Compile with `kmp.LossScaleOptimizer`, which skips "
                "such steps and keeps the weights intact."
            )
        elif self.diagnose_data is None:
            where = (
                "Pass `diagnose_data=` (a training batch) to NonFiniteGuard to locate the "
                "layer whose output overflows."
            )
        else:
            self.culprit, where = first_nonfinite_layer(model, self.diagnose_data)
            where = f"{where} {recalibration_hint(model, self.diagnose_data)}".rstrip()
        self.diagnosis = f"{what} at step {self._steps}: {why}. {where} {_FIX_HINT}"
        if self.action == "raise":
            raise FloatingPointError(self.diagnosis)
        logger.warning("NonFiniteGuard stops training. %s", self.diagnosis)
        model.stop_training = True

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def get_config(self):
        # `diagnose_data` is data, not configuration: it is not serialized.
        return {
            "patience": self.patience,
            "action": self.action,
            "check_weights_every": self.check_weights_every,
        }
