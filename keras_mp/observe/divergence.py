"""Telling a learning-rate blow-up from a float16 range problem, and `DivergenceGuard`.

A learning rate far too high and a float16 range problem can look the same to a loss
scaler: the gradients overflow, the scale backs off, steps are skipped. They need opposite
fixes (lower the learning rate; pin a layer to float32, or bfloat16), and under bfloat16 a
learning-rate blow-up overflows nothing at all: the loss just climbs. The evidence that
tells them apart, read without a float32 re-run and without a host sync per step:

* the loss trend (`LossTrend`): a finite loss that climbs far above its best before any
  overflow is a divergence (large-LM practice: a smoothed loss against its running minimum,
  a ratio over a window); a range problem is non-finite from the first step, or comes
  with a finite loss that still falls;
* the weights (`weight_norm`, read once when training begins and once when a guard fires):
  steps that blow up apply huge updates, so the weights' norm grows many times; a range
  problem's steps are skipped, so the weights stay as they were.

`DivergenceGuard` stops a run whose loss diverges under any policy (float32, bfloat16,
float16, lean); `CollapseGuard` and `NonFiniteGuard` use the same evidence to say which
cause they stopped for.

Example:

```python
guard = kmp.callbacks.DivergenceGuard(factor=3.0, patience=10)
model.fit(x, y, callbacks=[guard])
guard.cause   # "learning_rate" after a blow-up
```
"""

from __future__ import annotations

import logging
import math
import warnings

import keras
import numpy as np

from keras_mp.observe.telemetry import choice, positive_int, stop_or_raise

__all__ = [
    "DEFAULT_PATIENCE",
    "DivergenceError",
    "DivergenceGuard",
    "LossTrend",
    "cause_of_overflow",
    "divergence_diagnosis",
    "float16_weight_overflows",
    "initial_norm",
    "learning_rate",
    "learning_rate_advice",
    "learning_rate_at_step",
    "weight_norm",
]

logger = logging.getLogger("keras_mp")

# Consecutive risen steps before a guard fires.
DEFAULT_PATIENCE = 10
# The weights' norm growing this many times since training began: steps blew up.
WEIGHT_GROWTH = 10.0


class DivergenceError(RuntimeError):
    """Raised by `DivergenceGuard(action="raise")` when the loss diverges."""


class LossTrend:
    """The logged loss (Keras' running mean over the epoch) against its best so far.

    Feed it every step's `logs["loss"]` with the batch index. The first `min_steps`
    batches of an epoch are not judged (their running mean is a few batches' noise), except
    the very first batch, whose loss is the starting loss.

    Args:
        factor: a loss above `factor` times its best (above `best + (factor - 1) * |best|`)
            counts as risen, ...
        rise_fraction: ... when it has also climbed back more than this fraction of the way
            from its best to the starting loss (so a loss near 0 does not trip on noise).
        min_steps: batches of an epoch before its running mean is judged.
    """

    def __init__(self, factor: float = 3.0, rise_fraction: float = 0.5, min_steps: int = 5):
        self.factor = factor
        self.rise_fraction = rise_fraction
        self.min_steps = min_steps
        self.start: float | None = None
        self.best: float | None = None
        self.peak: float | None = None  # the highest finite loss after the best
        self.first_nonfinite: int | None = None  # global step of the first non-finite loss
        self.finite_before_nonfinite = 0
        self.steps = 0

    def update(self, batch: int, loss, first: bool | None = None) -> bool:
        """Records one step; returns whether the loss is now risen (or non-finite after a
        finite start).

        Args:
            batch: the batch index in its epoch.
            loss: the logged loss.
            first: whether this is the run's first step; None: the first one recorded
                (callbacks dispatched asynchronously may see the steps out of order).
        """
        self.steps += 1
        if loss is None:
            return False
        loss = float(loss)
        first = self.start is None if first is None else first
        if not math.isfinite(loss):
            if self.first_nonfinite is None:
                self.first_nonfinite = 0 if first else self.steps - 1
                self.finite_before_nonfinite = 0 if first else self.steps - 1
            return self.start is not None
        if first or self.start is None:  # steps seen before the first are not judged
            self.best = loss if self.best is None else min(self.best, loss)
            if first:
                self.start = loss
            return False
        if batch + 1 < self.min_steps:  # not judged against the best, but a rise counts
            risen = self.risen_value(loss)
            if risen and (self.peak is None or loss > self.peak):
                self.peak = loss
            return risen
        if loss < self.best:
            self.best, self.peak = loss, None
            return False
        risen = self.risen_value(loss)
        if self.peak is None or loss > self.peak:
            self.peak = loss
        return risen

    def risen_value(self, loss: float) -> bool:
        rise = loss - self.best
        return rise > (self.factor - 1) * abs(self.best) and rise > self.rise_fraction * (
            self.start - self.best
        )

    @property
    def ratio(self) -> float | None:
        """The highest finite loss since the best, over the best (None if not positive)."""
        if self.peak is None or self.best is None or self.best <= 0:
            return None
        return self.peak / self.best

    @property
    def diverged_finite(self) -> bool:
        """Whether a finite loss rose past the threshold at some step."""
        return self.peak is not None and self.risen_value(self.peak)

    def describe(self) -> str:
        parts = []
        if self.diverged_finite:
            ratio = self.ratio
            parts.append(
                f"the loss rose to {self.peak:.4g}"
                + (f", {ratio:.3g}x its lowest ({self.best:.4g})" if ratio else "")
                + f" (it started at {self.start:.4g})"
            )
        if self.first_nonfinite is not None:
            parts.append(
                f"it turned non-finite at step {self.first_nonfinite + 1}"
                + (
                    f" after {self.finite_before_nonfinite} finite step(s)"
                    if self.finite_before_nonfinite
                    else ", the first step"
                )
            )
        return "; ".join(parts)


def weight_norm(model) -> float:
    """The global L2 norm of `model`'s trainable weights (inf if one is inf, NaN if NaN).

    One reduction per variable on the device and one transfer; on JAX during `fit` the
    values are read from the training state (no full state sync).
    """
    variables = model.trainable_variables
    state = getattr(model, "_jax_state", None)
    values = None
    if state and not getattr(model, "_jax_state_synced", True):
        values = state.get("trainable_variables")
    if not values or len(values) != len(variables):
        values = [v.value for v in variables]
    if not values:
        return 0.0
    ops = keras.ops
    sums = ops.stack([ops.sum(ops.square(ops.cast(x, "float32"))) for x in values])
    total = float(np.sum(np.asarray(ops.convert_to_numpy(sums), dtype="float64")))
    return math.sqrt(total)  # inf where weights overflowed, NaN where a NaN step reached them


def initial_norm(model) -> float | None:
    """`weight_norm` when training begins (None where it cannot be read)."""
    try:
        return weight_norm(model)
    except Exception:  # noqa: BLE001 - a guard must not fail the run
        return None


def float16_weight_overflows(model) -> list[str]:
    """Layers computing in float16 that hold a weight (trainable or not: a `Normalization`
    adapted on large values keeps a variance of 1e9) beyond float16's 65,504, which the
    cast to the compute dtype turns into inf. In execution order where the model has one.

    Returns:
        Sentences like `"'normalization' (Normalization: variance up to 1.2e+09)"`.
    """
    out = []
    for layer in model._flatten_layers(include_self=False):
        if layer.compute_dtype != "float16" or list(layer._flatten_layers(include_self=False)):
            continue
        for v in layer.weights:
            if not keras.backend.is_float_dtype(v.dtype):
                continue
            top = float(np.max(np.abs(keras.ops.convert_to_numpy(v.value)), initial=0.0))
            if top > 65504.0:
                name = v.path.rsplit("/", 1)[-1]
                out.append(f"{layer.name!r} ({type(layer).__name__}: {name} up to {top:.3g})")
                break
    return out


def _current(model, variable):
    """`variable`'s value; during `fit` on JAX, from the training state (Keras frees the
    optimizer's own variables' values while it runs)."""
    state = getattr(model, "_jax_state", None)
    if state and not getattr(model, "_jax_state_synced", True):
        for v, value in zip(model.optimizer.variables, state.get("optimizer_variables") or ()):
            if v is variable:
                return value
    return variable.value


def learning_rate(model) -> float | None:
    """The optimizer's current learning rate (a schedule's value at this step), or None."""
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer  # kmp.LeanOptimizer keeps its own
    try:
        lr = opt._learning_rate
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            lr = lr(_current(model, opt.iterations))
        elif isinstance(lr, keras.Variable):
            lr = _current(model, lr)
        return float(keras.ops.convert_to_numpy(lr))
    except Exception:  # noqa: BLE001 - a custom optimizer without one
        return None


def learning_rate_at_step(model):
    """A function `step -> learning rate` read now, before `fit` runs (None if unknown).

    Read when training begins: during `fit` on JAX the optimizer's variables are freed
    and the training state's buffers are donated step to step, so a callback running on
    Keras' worker thread cannot read them safely. A schedule is evaluated at the
    optimizer's iteration count then plus the steps since.
    """
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer
    try:
        lr = opt._learning_rate
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            start = int(keras.ops.convert_to_numpy(opt.iterations))
            return lambda step: float(keras.ops.convert_to_numpy(lr(start + step)))
        value = float(keras.ops.convert_to_numpy(lr))
        return lambda step: value
    except Exception:  # noqa: BLE001 - a custom optimizer without one
        return None


def learning_rate_advice(model, lr: float | None = None) -> str:
    """The fixes for a learning-rate blow-up, naming the rate (`lr`, or the current one)."""
    lr = learning_rate(model) if lr is None else lr
    named = f"the learning rate ({lr:g})" if lr is not None else "the learning rate"
    lower = f" (e.g. {lr / 10:g})" if lr else ""
    return (
        f"{named} is too high for this model. Lower it{lower}, warm it up "
        "(`keras.optimizers.schedules.CosineDecay(..., warmup_target=lr, warmup_steps=...)`), "
        "or clip the gradients (`clipnorm=1.0` on the optimizer). Another precision will not "
        "help: bfloat16 or float32 only hide the overflow and let the loss climb."
    )


def cause_of_overflow(trend: LossTrend, growth: float | None) -> str | None:
    """`"learning_rate"`, `"range"` or None (no evidence either way), from the loss trend
    and the growth of the weights' norm since training began (`now / start`)."""
    if trend.diverged_finite or (growth is not None and growth >= WEIGHT_GROWTH):
        return "learning_rate"
    if trend.first_nonfinite == 0 or (growth is not None and growth < 2.0):
        return "range"
    return None


def growth_since(norm0: float | None, model) -> float | None:
    """How many times the weights' norm grew since `norm0` (None if unknown)."""
    if not norm0:
        return None
    try:
        return weight_norm(model) / norm0
    except Exception:  # noqa: BLE001 - a diagnosis must not fail the run
        return None


def evidence(trend: LossTrend, growth: float | None) -> str:
    parts = [trend.describe()] if trend.describe() else []
    if growth is not None:
        parts.append(
            "the weights' norm is "
            + (
                "NaN (a NaN step reached them)"
                if math.isnan(growth)
                else "inf (updates overflowed them)"
                if math.isinf(growth)
                else f"{growth:.3g}x what it was"
            )
            + " since training began"
        )
    return "; ".join(parts)


def divergence_diagnosis(
    model, trend: LossTrend, norm0: float | None, step: int, lr: float | None = None
):
    """`(cause, sentence)` for a loss that diverged by step `step` (`lr`: the learning
    rate then, where the caller knows it)."""
    growth = growth_since(norm0, model)
    cause = cause_of_overflow(trend, growth)
    seen = evidence(trend, growth)
    if cause == "range":
        advice = (
            "The weights did not grow, so this is no learning-rate blow-up: values overflow "
            "the compute dtype. NonFiniteGuard(diagnose_data=batch) names the layer; "
            "kmp.convert(model, policy, calibrate=data) pins it to float32."
        )
    else:
        cause = "learning_rate"
        advice = "This is a divergence: " + learning_rate_advice(model, lr)
    return cause, f"Divergence at step {step}: {seen}. {advice}"


@keras.saving.register_keras_serializable(package="keras_mp")
class DivergenceGuard(keras.callbacks.Callback):
    """Stops a run whose loss diverges, under any policy, and names the learning rate.

    A learning rate far too high makes the loss climb and stay up (or go non-finite) while
    no weight overflows under bfloat16 or float32, so no loss-scale guard fires. This guard
    watches the loss Keras logs (the epoch's running mean) against its lowest value so far:
    it fires when the loss stays above `factor` times its best, and more than
    `rise_fraction` of the way back to where it started, for `patience` consecutive
    steps; or when a loss that started finite stays non-finite that long. Firing reads the
    weights once: when their norm grew `10`x or more since training began (steps that blew
    up), or the finite loss climbed first, the cause is the learning rate, and the message
    names its value and the fixes (lower it, warm it up, clip the gradients); otherwise
    it points at float16's range (`NonFiniteGuard` and `CollapseGuard` locate the layer).

    It reads nothing from the device on other steps and is safe for Keras' asynchronous
    callback dispatch (`async_safe`): alone with the progress bar off, it adds no host
    sync to the training loop. `CollapseGuard` runs the same check by default
    (`divergence=True`).

    Args:
        factor: the ratio over the best loss that counts as risen (> 1).
        rise_fraction: the fraction of the way back to the starting loss that must also
            be climbed, in (0, 1].
        patience: consecutive risen steps before firing.
        min_steps: batches of each epoch before its running mean is judged.
        action: `"stop"` (set `model.stop_training`, log), `"raise"` (`DivergenceError`)
            or `"warn"` (one `UserWarning`, training goes on: what `fit` adds by default
            to a low-precision model, `keras_mp.observe.fit_guard`).

    Example:

    >>> guard = kmp.callbacks.DivergenceGuard(patience=10)
    >>> model.fit(x, y, callbacks=[guard])  # doctest: +SKIP
    >>> guard.cause  # doctest: +SKIP
    'learning_rate'
    """

    async_safe = True
    warning_prefix = "DivergenceGuard: "

    def __init__(
        self,
        factor: float = 3.0,
        rise_fraction: float = 0.5,
        patience: int = DEFAULT_PATIENCE,
        min_steps: int = 5,
        action: str = "stop",
    ):
        super().__init__()
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
            raise ValueError(f"DivergenceGuard: `factor` must be a number > 1, got {factor!r}.")
        if (
            isinstance(rise_fraction, bool)
            or not isinstance(rise_fraction, (int, float))
            or not 0 < rise_fraction <= 1
        ):
            raise ValueError(
                f"DivergenceGuard: `rise_fraction` must be in (0, 1], got {rise_fraction!r}."
            )
        self.factor = float(factor)
        self.rise_fraction = float(rise_fraction)
        self.patience = positive_int("DivergenceGuard", "patience", patience)
        self.min_steps = positive_int("DivergenceGuard", "min_steps", min_steps)
        self.action = choice("DivergenceGuard", "action", action, ("stop", "raise", "warn"))
        self.diagnosis: str | None = None
        self.cause: str | None = None
        self.stopped_step: int | None = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._first_epoch is None:
            self._first_epoch = epoch
        self._epoch = epoch

    def on_train_begin(self, logs=None):
        self._first_epoch = self._epoch = None
        self.trend = LossTrend(self.factor, self.rise_fraction, self.min_steps)
        self._norm0 = initial_norm(self._model)
        self._lr_at = learning_rate_at_step(self._model)
        self._risen = 0
        self.diagnosis = self.cause = self.stopped_step = None

    def on_train_batch_end(self, batch, logs=None):
        if self.stopped_step is not None:
            return
        # Keras may dispatch this on a worker thread, steps out of order within an epoch.
        first = batch == 0 and self._epoch == self._first_epoch
        risen = self.trend.update(batch, (logs or {}).get("loss"), first=first)
        self._risen = self._risen + 1 if risen else 0
        if self._risen >= self.patience:
            self._fire()

    def _fire(self):
        model = self._model  # not `self.model`: no JAX state sync from Keras' callback thread
        self.stopped_step = self.trend.steps
        lr = self._lr_at(self.stopped_step) if self._lr_at else None
        self.cause, self.diagnosis = divergence_diagnosis(
            model, self.trend, self._norm0, self.stopped_step, lr
        )
        if self.action == "warn":
            warnings.warn(self.warning_prefix + self.diagnosis, UserWarning, stacklevel=2)
            return
        stop_or_raise("DivergenceGuard", self.action, model, self.diagnosis, DivergenceError)

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def get_config(self):
        return {
            "factor": self.factor,
            "rise_fraction": self.rise_fraction,
            "patience": self.patience,
            "min_steps": self.min_steps,
            "action": self.action,
        }
