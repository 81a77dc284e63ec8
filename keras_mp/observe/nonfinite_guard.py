"""`NonFiniteGuard`: stops a run whose loss or weights went non-finite, and says where.

Split out of `keras_mp.observe.callbacks` (which exports it as `kmp.callbacks.NonFiniteGuard`),
with `recalibration_hint`, the part of its diagnosis that names layers to pin.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import keras
import numpy as np

from keras_mp.conversion.probe import first_nonfinite_layer, to_numpy, unpack
from keras_mp.numerics.label_range import bad_label_message
from keras_mp.observe.divergence import (
    LossTrend,
    cause_of_overflow,
    evidence,
    growth_since,
    initial_norm,
    learning_rate_advice,
)
from keras_mp.observe.telemetry import (
    Telemetry,
    choice,
    counting_optimizer,
    nonfinite_weights,
    positive_int,
    stop_or_raise,
)

__all__ = ["NonFiniteGuard", "recalibration_hint"]

logger = logging.getLogger("keras_mp")


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


def _labels_problem(model, data) -> str:
    """Names out-of-range class labels in `data` (`(x, y)`) for `model`'s sparse loss.

    For a `NonFiniteGuard` diagnosis: under XLA an out-of-range label shows up only as a NaN
    loss. Reads `model.loss` (a sparse cross-entropy object or its string name) and the
    class count off the model's output.

    Returns:
        The `bad_label_message` sentence, or "" when nothing is wrong or nothing can be told.
    """
    loss = getattr(model, "loss", None)
    name = loss if isinstance(loss, str) else type(loss).__name__
    if name not in ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy"):
        return ""
    try:
        x, y, _ = unpack(data)
        if y is None:
            return ""
        outputs = getattr(model, "outputs", None)
        classes = outputs[0].shape[-1] if outputs and len(outputs) == 1 else None
        if classes is None:
            classes = to_numpy(model(x)).shape[-1]
        labels = np.asarray(to_numpy(y)).astype("int64")
    except Exception:  # noqa: BLE001 - a diagnosis must not fail the run
        return ""
    ignore = getattr(loss, "ignore_class", None)
    bad = (labels < 0) | (labels >= classes)
    if ignore is not None:
        bad &= labels != ignore
    if not bad.any():
        return ""
    return (
        f"diagnose_data holds {int(bad.sum())} label(s) outside the class range, the likely "
        f"cause (under XLA they make the loss NaN): "
        + bad_label_message("SparseCategoricalCrossentropy", classes, labels[bad], ignore)
    )


_FIX_HINT = (
    "Loss scaling cannot fix non-finite values produced in the forward pass or by the loss: "
    "run `kmp.audit(model, (x, y))` to find activations above the float16 maximum, pin those "
    "layers to float32 (`kmp.layers.Float32`, or `keep_fp32` in `kmp.Policy`), or train "
    "with 'mixed_bfloat16', which has the range of float32."
)


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
        self.diagnosis = self.culprit = self.stopped_step = self.cause = None
        self._trend = LossTrend()
        self._norm0 = initial_norm(self._model)

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
        self._trend.update(batch, loss)
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
        growth = growth_since(self._norm0, model)
        self.cause = cause_of_overflow(self._trend, growth)
        if self.cause == "learning_rate":  # the weights grew: no layer is to blame
            self.diagnosis = (
                f"{what} at step {self._steps}: {why}. "
                "Not a problem of the compute dtype's range: "
                f"{evidence(self._trend, growth)}, so the steps themselves blow up: "
                f"{learning_rate_advice(model)}"
            )
            self._stop(model)
            return
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
            labels = _labels_problem(model, self.diagnose_data)
            if labels and self.culprit is None:  # the labels, not the range: say only that
                self.diagnosis = f"{what} at step {self._steps}: {why}. {labels}"
                self._stop(model)
                return
            where = f"{where} {recalibration_hint(model, self.diagnose_data)}".rstrip()
        self.diagnosis = f"{what} at step {self._steps}: {why}. {where} {_FIX_HINT}"
        self._stop(model)

    def _stop(self, model):
        stop_or_raise("NonFiniteGuard", self.action, model, self.diagnosis, FloatingPointError)

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
