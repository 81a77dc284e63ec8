"""Reading loss-scale telemetry during `fit` without a host sync, and writing it out.

Private helpers of `keras_mp.observe.callbacks`. On the JAX backend `fit` keeps the state in
`model._jax_state` during an epoch (the model's variables are detached); touching
`callback.model` would sync all of it, so `_StateReader` reads single optimizer variables
from that state instead.
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
import warnings

import keras
import numpy as np

from keras_mp.scaling.loss_scale import LossScaleOptimizer

__all__ = [
    "ScalarWriter",
    "StateReader",
    "StepCounter",
    "Telemetry",
    "choice",
    "counting_optimizer",
    "has_tensorboard",
    "loss_scale_optimizer",
    "nonfinite_weights",
    "positive_int",
    "stop_or_raise",
    "unscaled_reason",
]

logger = logging.getLogger("keras_mp")


def loss_scale_optimizer(model) -> keras.optimizers.LossScaleOptimizer | None:
    opt = getattr(model, "optimizer", None)
    return opt if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None


def counting_optimizer(model) -> keras.optimizers.Optimizer | None:
    """The model's optimizer when it skips non-finite steps and keeps their count: a
    `LossScaleOptimizer` (Keras' own derives its count) or a `kmp.LeanOptimizer`."""
    from keras_mp.lean import LeanOptimizer

    opt = getattr(model, "optimizer", None)
    if isinstance(opt, (keras.optimizers.LossScaleOptimizer, LeanOptimizer)):
        return opt
    return None


def nonfinite_weights(model) -> list[str]:
    """Paths of the model's trainable variables holding an inf or NaN.

    One finiteness reduction per variable on the device and one small transfer; on JAX
    during `fit` the values are read from the training state (no full state sync).

    Returns:
        A list of variable paths (empty when every weight is finite).
    """
    variables = model.trainable_variables
    values = None
    state = getattr(model, "_jax_state", None)
    if state and not getattr(model, "_jax_state_synced", True):
        values = state.get("trainable_variables")
    if not values or len(values) != len(variables):
        values = [v.value for v in variables]
    if not values:
        return []
    ops = keras.ops
    flags = ops.convert_to_numpy(ops.stack([ops.all(ops.isfinite(x)) for x in values]))
    return [v.path for v, ok in zip(variables, np.asarray(flags)) if not ok]


_said: set = set()


def _compute_dtypes(model) -> list[str]:
    dtypes = {layer.compute_dtype for layer in model._flatten_layers(include_self=True)}
    return sorted(d for d in dtypes if d)


def unscaled_reason(model, who: str) -> str | None:
    """Why `model` trains without loss scaling, or None when it needs (or has) a scaler.

    A model whose optimizer is not a `LossScaleOptimizer` and none of whose layers computes
    in float16 (float32, bfloat16, float8 policies) needs no loss scaling: the callbacks
    that watch the scale have nothing to do. The reason is logged once per process per
    callback kind and returned (so the callback can keep it).
    """
    if counting_optimizer(model) is not None:
        return None
    dtypes = _compute_dtypes(model)
    if "float16" in dtypes:
        return None
    policy = getattr(getattr(model, "dtype_policy", None), "name", None)
    reason = (
        f"{who}: model {model.name!r} computes in {' and '.join(dtypes) or 'float32'}"
        + (f" (policy {policy!r})" if policy else "")
        + " and trains without loss scaling, which only float16 needs (bfloat16 and float32 "
        f"have float32's range): there is no loss scale to watch, so {who} does nothing in "
        "this fit."
    )
    if (who, reason) not in _said:
        _said.add((who, reason))
        logger.warning(reason)
    return reason


class StateReader:
    """Reads optimizer variables of `model`, from the JAX training state when it is live."""

    def __init__(self, model):
        self.model = model
        self._index: dict[int, int] | None = None

    def read(self, variable) -> np.ndarray:
        model = self.model
        state = getattr(model, "_jax_state", None)
        if state and not getattr(model, "_jax_state_synced", True):
            values = state.get("optimizer_variables")
            if values:
                if self._index is None:
                    self._index = {id(v): i for i, v in enumerate(model.optimizer.variables)}
                i = self._index.get(id(variable))
                if i is not None:
                    return np.asarray(values[i])
        return keras.ops.convert_to_numpy(variable.value)


class Telemetry:
    """The loss-scale quantities of a (keras_mp or stock Keras) LossScaleOptimizer, or the
    skip counter of a `kmp.LeanOptimizer` (no scale: it reads as a static 1)."""

    def __init__(self, model, who: str):
        opt = counting_optimizer(model)
        if opt is None:
            name = type(getattr(model, "optimizer", None)).__name__
            raise ValueError(
                f"{who} needs a model compiled with a LossScaleOptimizer, but the model's "
                f"optimizer is {name} while layers of model {model.name!r} compute in float16, "
                "whose small gradients underflow without loss scaling. Wrap it: "
                "`kmp.LossScaleOptimizer(optimizer)` (compiling under a keras_mp float16 "
                "policy wraps it automatically), or train under 'mixed_bfloat16', which "
                "needs no loss scaling."
            )
        self.optimizer = opt
        self.reader = StateReader(model)
        self.lean = not isinstance(opt, keras.optimizers.LossScaleOptimizer)
        # Stock Keras has no skip counter: skips are then derived from `iterations`.
        self.has_counter = self.lean or isinstance(opt, LossScaleOptimizer)
        if not self.has_counter:
            from keras_mp.scaling.autoscale import stock_scaler_message

            warnings.warn(f"{who}: {stock_scaler_message(model)}", UserWarning, stacklevel=3)
        keras_mp_scaler = isinstance(opt, LossScaleOptimizer)
        self.min_scale = float(opt.min_scale) if keras_mp_scaler else 1.0
        # A static scale (the fixed 1 of bfloat16 and float32, or lean's none) cannot
        # collapse: only the skip rate says anything about it.
        self.dynamic = not self.lean and (not keras_mp_scaler or opt.dynamic)
        # no scale worth logging: lean's none, or the fixed 1 that only skips
        self.has_scale = not self.lean and not getattr(opt, "skip_only", False)

    def scale(self) -> float:
        if self.lean:
            return 1.0
        if not self.optimizer.built:  # TensorFlow builds it in the first step
            return float(self.optimizer.initial_scale)
        return float(self.reader.read(self.optimizer.dynamic_scale))

    def applied(self) -> int:
        if self.lean:  # its `iterations` counts skipped steps too
            if not self.optimizer.built:
                return 0
            return int(self.reader.read(self.optimizer.iterations)) - self.skipped()
        return int(self.reader.read(self.optimizer.inner_optimizer.iterations))

    def skipped(self) -> int | None:
        if not self.has_counter:
            return None
        if not self.optimizer.built:
            return 0
        return int(self.reader.read(self.optimizer.skipped_steps))


class StepCounter:
    """Steps and skipped steps since `on_train_begin`, for either optimizer kind."""

    def __init__(self, telemetry: Telemetry):
        self.t = telemetry
        self.steps_before_epoch = 0
        self.epoch_steps = 0
        self.applied0 = telemetry.applied()
        self.skipped0 = telemetry.skipped()

    def begin_epoch(self):
        self.steps_before_epoch += self.epoch_steps
        self.epoch_steps = 0

    def end_batch(self, batch: int):
        self.epoch_steps = batch + 1

    @property
    def steps(self) -> int:
        return self.steps_before_epoch + self.epoch_steps

    def skipped(self) -> int:
        """Total skipped steps (the optimizer's counter; derived for stock Keras)."""
        if self.t.has_counter:
            return self.t.skipped()
        return self.steps - (self.t.applied() - self.applied0)


def has_tensorboard() -> bool:
    return all(importlib.util.find_spec(m) for m in ("tensorflow", "tensorboard"))


class ScalarWriter:
    def __init__(self, log_dir: str, log_format: str):
        self.log_dir = log_dir
        has_tb = has_tensorboard()
        if log_format == "auto":
            log_format = "tensorboard" if has_tb else "csv"
            if not has_tb:
                logger.warning(
                    "LossScaleMonitor: TensorFlow and TensorBoard are not both installed, so "
                    "no TensorBoard events can be written; writing %s instead.",
                    os.path.join(log_dir, "loss_scale.csv"),
                )
        elif log_format == "tensorboard" and not has_tb:
            raise ImportError(
                "LossScaleMonitor(log_format='tensorboard') needs the `tensorflow` and "
                "`tensorboard` packages; install them or use log_format='csv'."
            )
        self.format = log_format
        os.makedirs(log_dir, exist_ok=True)
        if log_format == "tensorboard":
            import tensorflow as tf

            self._tf = tf
            self._writer = tf.summary.create_file_writer(os.path.join(log_dir, "train"))
        else:
            path = os.path.join(log_dir, "loss_scale.csv")
            new = not os.path.exists(path)
            self._file = open(path, "a", newline="")
            self._csv = csv.writer(self._file)
            if new:
                self._csv.writerow(["tag", "step", "value"])

    def write(self, scalars: dict[str, float], step: int):
        if self.format == "tensorboard":
            with self._writer.as_default(step=step):
                for tag, value in scalars.items():
                    self._tf.summary.scalar(tag, value)
        else:
            for tag, value in scalars.items():
                self._csv.writerow([tag, step, value])

    def close(self):
        if self.format == "tensorboard":
            self._writer.flush()
            self._writer.close()
        else:
            self._file.close()


def positive_int(owner: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{owner}: `{name}` must be a positive integer, got {value!r}.")
    return int(value)


def choice(owner: str, name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(
            f"{owner}: `{name}` must be one of {', '.join(map(repr, choices))}, got {value!r}."
        )
    return value


def stop_or_raise(owner: str, action: str, model, diagnosis: str, error: type) -> None:
    """What a guard does when it fires: `action="raise"` raises `error(diagnosis)`,
    `"stop"` logs the diagnosis and sets `model.stop_training`."""
    if action == "raise":
        raise error(diagnosis)
    logger.warning("%s stops training. %s", owner, diagnosis)
    model.stop_training = True
