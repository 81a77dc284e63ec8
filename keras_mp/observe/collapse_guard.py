"""`CollapseGuard`: stops a run whose loss scaling collapsed, and says why.

Split out of `keras_mp.observe.callbacks` (which exports it as `kmp.callbacks.CollapseGuard`).
It tells a learning-rate blow-up from a float16 range problem with the evidence of
`keras_mp.observe.divergence`, and runs `DivergenceGuard`'s check by default.
"""

from __future__ import annotations

import logging
import math
from collections import deque

import keras

from keras_mp.conversion.probe import first_nonfinite_layer
from keras_mp.observe.divergence import (
    DEFAULT_PATIENCE,
    LossTrend,
    cause_of_overflow,
    divergence_diagnosis,
    evidence,
    float16_weight_overflows,
    growth_since,
    initial_norm,
    learning_rate_advice,
)
from keras_mp.observe.nonfinite_guard import recalibration_hint
from keras_mp.observe.telemetry import (
    StepCounter,
    Telemetry,
    choice,
    positive_int,
    stop_or_raise,
    unscaled_reason,
)

__all__ = ["CollapseGuard", "LossScaleCollapseError"]

logger = logging.getLogger("keras_mp")


class LossScaleCollapseError(RuntimeError):
    """Raised by `CollapseGuard(action="raise")` when loss scaling can no longer help."""


_CALIBRATE_HINT = (
    "Pin it to float32: kmp.convert(model, 'mixed_float16', calibrate=training batches) "
    "pins the layers that pass float16's range on your data (or `kmp.layers.Float32`)."
)

_COLLAPSE_HINT = (
    "The gradients stay non-finite however far the scale backs off while the weights stay "
    "as they were, so loss scaling cannot fix them: an op with an infinite derivative (sqrt "
    "or log at 0) or activations above the float16 maximum (run `kmp.audit(model, (x, y))`); "
    "pin those layers to float32 (`kmp.convert(model, 'mixed_float16', calibrate=data)`, "
    "`kmp.layers.Float32`), or train with 'mixed_bfloat16'."
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
    `self.diagnosis` (with the step in `self.stopped_step` and `"learning_rate"` or
    `"range"` in `self.cause`), says what happened and why, from evidence read when it
    fires (`keras_mp.observe.divergence`): a finite loss that climbed before the overflows,
    or weights whose norm grew 10x or more, is a learning rate far too high, and the
    diagnosis names its value and the fixes (lower it, warm it up, clip), not float16's
    range; otherwise it names the layer that overflows first: the first layer computing in
    float16 that holds a weight beyond float16's range (a `Normalization` adapted on large
    values), or with `diagnose_data` the first layer whose output is non-finite, and points
    at `kmp.convert(..., calibrate=data)`. With `divergence=True` (default) it also stops
    a run whose finite loss diverges with no overflow at all (`DivergenceGuard`'s check,
    from the loss Keras logs), so a learning rate far too high is caught under bfloat16 too.
    A static
    scale cannot collapse: under the fixed 1 of `"mixed_bfloat16"`, `"float32"` and
    `"float8"` (compiled through keras_mp) and under `"lean_bfloat16"` only the skip rate
    is judged. A model whose optimizer neither scales nor skips and that computes in no
    float16 gives the guard nothing to read: it then does nothing and says why once
    (`self.idle_reason`); use `NonFiniteGuard` to stop such a run.

    Args:
        patience: consecutive checks at the floor before firing.
        min_scale: the floor; `None` uses the optimizer's `min_scale`.
        max_skip_rate: fire when the fraction of skipped steps over the last `window`
            steps exceeds this, in (0, 1].
        window: steps over which the skip rate is measured (it is judged once that many
            steps have run in this `fit`).
        action: `"stop"` or `"raise"`.
        check_every: read the optimizer every this many steps.
        divergence: also stop a diverging finite loss (`DivergenceGuard` with its
            defaults); `False` turns that check off.
        diagnose_data: optional `x` or `(x, y)` (a training batch) on which to locate the
            first layer whose output is non-finite when the scale collapses.

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
        divergence: bool = True,
        diagnose_data=None,
    ):
        super().__init__()
        self.divergence = bool(divergence)
        self.diagnose_data = diagnose_data
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
        self.cause = None
        self._trend = LossTrend()
        self._risen = 0
        self._norm0 = initial_norm(self._model)
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
        if self.stopped_step is not None:
            return
        risen = self._trend.update(batch, (logs or {}).get("loss"))
        self._risen = self._risen + 1 if risen else 0
        if self.divergence and self._risen >= DEFAULT_PATIENCE:
            self._diverged()
            return
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

    def _diverged(self):
        self.stopped_step = self._trend.steps
        self.cause, self.diagnosis = divergence_diagnosis(
            self.model, self._trend, self._norm0, self.stopped_step
        )
        self._stop()

    def _fire(self, what: str, step: int, skipped: int):
        model = self.model  # `self.model` syncs the JAX state once, here.
        self.stopped_step = step
        growth = growth_since(self._norm0, model)
        self.cause = cause_of_overflow(self._trend, growth)
        head = f"Loss-scale collapse at step {step}: {what}; {skipped} step(s) skipped in total."
        if self.cause == "learning_rate":
            self.diagnosis = (
                f"{head} Not a problem of the compute dtype's range: "
                f"{evidence(self._trend, growth)}, so the "
                f"steps themselves blow up: {learning_rate_advice(model)}"
            )
        else:
            where, located = self._where(model)
            self.diagnosis = f"{head} {where}" + ("" if located else f" {_COLLAPSE_HINT}")
        self._stop()

    def _where(self, model) -> tuple[str, bool]:
        """Where the overflow starts, and whether a layer was named (else the variables
        whose gradients overflowed)."""
        if self.diagnose_data is not None:
            layer, where = first_nonfinite_layer(model, self.diagnose_data)
            if layer is not None:
                hint = recalibration_hint(model, self.diagnose_data) or _CALIBRATE_HINT
                return f"{where} {hint}", True
        heavy = float16_weight_overflows(model)
        if heavy:
            return (
                f"The overflow starts upstream of the gradients: {', '.join(heavy[:3])} "
                "compute(s) in float16 with weights beyond its 65,504, which the cast to "
                "float16 makes inf (a Normalization adapted on large values). Pin it to "
                "float32: kmp.convert(model, 'mixed_float16', calibrate=training batches) "
                "pins the layers that pass float16's range on your data."
            ), True
        opt = model.optimizer
        if hasattr(opt, "nonfinite_variable_names"):
            names = opt.nonfinite_variable_names()
            culprits = (
                "Gradients were non-finite in the last overflow for: " + ", ".join(names) + "."
                if names
                else "No variable is recorded with a non-finite gradient."
            )
        else:
            culprits = "(Keras' LossScaleOptimizer does not record which gradients overflowed.)"
        locate = (
            ""
            if self.diagnose_data is not None
            else " Pass `diagnose_data=` (a training batch) to name the first layer that "
            "overflows; layers downstream of it overflow too."
        )
        return culprits + locate, False

    def _stop(self):
        stop_or_raise(
            "CollapseGuard", self.action, self.model, self.diagnosis, LossScaleCollapseError
        )

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
            "divergence": self.divergence,
        }
