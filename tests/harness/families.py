"""The program families: each one's data (seeded, labels learnable from the inputs) and its
model, built with public Keras layers the way users write them (custom layers with their own
`get_config`, a `train_step` override as Keras' guide writes it).

`programs` draws a `Program` and runs it; this module only builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
import numpy as np
from keras import ops

if TYPE_CHECKING:
    from .programs import Program

__all__ = [
    "CLASSES",
    "N",
    "ActivityPenalty",
    "Block",
    "GuideTrainStep",
    "build",
    "data",
    "event_data",
    "targets",
]

CLASSES = 4
N = 48  # samples: 3 batches of 16


# ---------------------------------------------------------------------------- data


def data(p: Program) -> tuple[Any, Any]:
    """Inputs and integer labels for the family (labels learnable from the inputs)."""
    rng = np.random.default_rng([p.seed, 7])
    f = p.family
    if f in ("rnn_mask", "attention", "emb_int", "emb_float"):
        vocab = 3000 if f == "emb_float" else 20
        lo = 2000 if f == "emb_float" else 1
        ids = rng.integers(lo, vocab, (N, 8))
        if f == "rnn_mask":
            lengths = rng.integers(3, 9, N)
            ids = np.where(np.arange(8)[None] < lengths[:, None], ids, 0)
        y = ids[:, 0] % CLASSES
        return ids.astype("float32" if f == "emb_float" else "int32"), y
    if f == "conv_bn":
        x = rng.normal(size=(N, 8, 8, 1)).astype("float32")
        y = np.argmax(x.reshape(N, 4, 16).mean(-1), -1)
        return x, y
    x = rng.normal(size=(N, 8)).astype("float32")
    w = rng.normal(size=(8, CLASSES))
    y = np.argmax(x @ w, -1)
    if f == "preprocess":
        x = (x * 2e4 + 5e4).astype("float32")  # the user's raw, large-valued features
    if f == "multi_io":
        x2 = rng.normal(size=(N, 4)).astype("float32")
        y2 = (x2[:, 0] > 0).astype("int64") + 2 * (x2[:, 1] > 0)
        return {"a": x, "b": x2}, {"out1": y, "out2": y2}
    if f == "shared":
        return {"a": x, "b": x[:, ::-1].copy()}, y
    return x, y


def event_data(p: Program, x, y):
    """Applies the data event (a NaN sample, an out-of-range label) to one batch."""
    first = lambda d: d[sorted(d)[0]] if isinstance(d, dict) else d
    if p.event == "nan_sample":
        xs = first(x)
        if xs.dtype.kind == "f" and p.family != "emb_float":
            xs[5].flat[0] = np.nan
        else:  # integer ids cannot hold a NaN: use the other event
            first(y)[5] = CLASSES + 3
    if p.event == "bad_label":
        first(y)[5] = CLASSES + 3
    return x, y


def targets(p: Program, y):
    """Labels in the loss' format (one-hot for the one-hot losses)."""
    if "onehot" not in p.loss:
        return y
    onehot = lambda v, k: np.eye(k, dtype="float32")[np.clip(v, 0, k - 1)]
    if isinstance(y, dict):
        return {k: onehot(v, CLASSES) for k, v in y.items()}
    return onehot(y, CLASSES)


# ---------------------------------------------------------------------------- models


@keras.saving.register_keras_serializable(package="kmp_harness")
class Block(keras.layers.Layer):
    """A custom layer with sublayers and its own get_config (Keras' subclassing guide)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = keras.layers.Dense(units, activation="relu")
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(self.dense(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="kmp_harness")
class ActivityPenalty(keras.layers.Layer):
    """Adds `rate * sum(x**2)` with `add_loss` (the training-loop guide's pattern)."""

    def __init__(self, rate=1e-2, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, x):
        self.add_loss(self.rate * ops.sum(ops.square(x)))
        return x

    def get_config(self):
        return {**super().get_config(), "rate": self.rate}


def _body(p: Program, pin: bool):
    """(inputs, outputs) of the family's functional graph; `pin` builds one layer in
    float32 by the user's own `dtype="float32"` (it is named "pinned")."""
    L = keras.layers
    pin_kw = {"dtype": "float32", "name": "pinned"} if pin else {}
    f = p.family
    if f == "dense":
        i = keras.Input((8,), name="a")
        h = L.Dense(16, activation="relu", **pin_kw)(i)
        h = L.Dense(16, activation="relu")(h)
        return i, L.Dense(CLASSES, name="out1")(h)
    if f == "conv_bn":
        i = keras.Input((8, 8, 1), name="a")
        h = L.Conv2D(8, 3, padding="same", **pin_kw)(i)
        h = L.BatchNormalization()(h)
        h = L.ReLU()(h)
        h = L.MaxPooling2D()(h)
        h = L.Conv2D(8, 3, padding="same", activation="relu")(h)
        h = L.GlobalAveragePooling2D()(h)
        return i, L.Dense(CLASSES, name="out1")(h)
    if f == "rnn_mask":
        i = keras.Input((8,), dtype="int32", name="a")
        h = L.Embedding(20, 8, mask_zero=True)(i)
        rnn = L.LSTM if p.seed % 2 else L.GRU
        h = rnn(8, **pin_kw)(h)
        return i, L.Dense(CLASSES, name="out1")(h)
    if f == "attention":
        i = keras.Input((8,), dtype="int32", name="a")
        h = L.Embedding(20, 16)(i)
        a = L.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
        h = L.LayerNormalization()(L.Add()([h, a]))
        m = L.Dense(32, activation="gelu", **pin_kw)(h)
        h = L.LayerNormalization()(L.Add()([h, L.Dense(16)(m)]))
        h = L.GlobalAveragePooling1D()(h)
        return i, L.Dense(CLASSES, name="out1")(h)
    if f in ("emb_int", "emb_float"):
        int_ids = f == "emb_int"
        i = keras.Input((8,), dtype="int32" if int_ids else "float32", name="a")
        h = L.Embedding(20 if int_ids else 3000, 8)(i)
        h = L.Flatten()(h)
        h = L.Dense(16, activation="relu", **pin_kw)(h)
        return i, L.Dense(CLASSES, name="out1")(h)
    if f == "custom":
        i = keras.Input((8,), name="a")
        h = Block(16, **pin_kw)(i)
        h = Block(16)(h)
        return i, L.Dense(CLASSES, name="out1")(h)
    if f == "shared":
        a, b = keras.Input((8,), name="a"), keras.Input((8,), name="b")
        shared = L.Dense(16, activation="relu", **pin_kw)
        h = L.Concatenate()([shared(a), shared(b)])
        return [a, b], L.Dense(CLASSES, name="out1")(h)
    if f == "frozen":
        bi = keras.Input((8,))
        bh = L.Dense(16, activation="relu", **pin_kw)(bi)
        base = keras.Model(bi, L.Dense(16, activation="relu")(bh), name="base")
        base.trainable = bool(p.seed % 2)  # odd seeds: fine-tune the sub-model
        i = keras.Input((8,), name="a")
        return i, L.Dense(CLASSES, name="out1")(base(i))
    if f == "preprocess":
        i = keras.Input((8,), name="a")
        norm = L.Normalization(name="norm")
        x, _ = data(p)
        norm.adapt(x)  # on the user's data, as the preprocessing guide does
        h = L.Dense(16, activation="relu", **pin_kw)(norm(i))
        return i, L.Dense(CLASSES, name="out1")(h)
    if f == "added_loss":
        i = keras.Input((8,), name="a")
        h = L.Dense(
            16,
            activation="relu",
            kernel_regularizer=keras.regularizers.L2(1e-3),
            activity_regularizer=keras.regularizers.L2(1e-4),
            **pin_kw,
        )(i)
        h = ActivityPenalty(1e-2)(h)
        return i, L.Dense(CLASSES, name="out1")(h)
    if f == "multi_io":
        a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
        ha = L.Dense(16, activation="relu", **pin_kw)(a)
        hb = L.Dense(8, activation="relu")(b)
        h = L.Concatenate()([ha, hb])
        return [a, b], {
            "out1": L.Dense(CLASSES, name="out1")(h),
            "out2": L.Dense(4, name="out2")(h),
        }
    raise ValueError(f"unknown family {f!r}")


class GuideTrainStep(keras.Model):
    """A `train_step` override written as Keras' "Customizing fit()" guide writes it
    (backend by backend; the loss is not scaled, as in the guide)."""

    def train_step(self, *args):
        if keras.backend.backend() == "jax":
            return self._jax_train_step(*args)  # (state, data) on JAX
        import tensorflow as tf

        (data,) = args

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return self._guide_metrics(loss, y, y_pred)

    def _guide_metrics(self, loss, y, y_pred):
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def compute_loss_and_updates(self, trainable, non_trainable, x, y, training=False):
        y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=training)
        loss = self.compute_loss(x, y, y_pred)
        return loss, (y_pred, non_trainable)

    def _jax_train_step(self, state, data):
        import jax

        trainable, non_trainable, opt_vars, metrics_vars = state
        x, y = data
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
        (loss, (y_pred, non_trainable)), grads = grad_fn(
            trainable, non_trainable, x, y, training=True
        )
        trainable, opt_vars = self.optimizer.stateless_apply(opt_vars, grads, trainable)
        new_metrics_vars, logs = [], {}
        for metric in self.metrics:
            start = len(new_metrics_vars)
            these = metrics_vars[start : start + len(metric.variables)]
            if metric.name == "loss":
                these = metric.stateless_update_state(these, loss)
            else:
                these = metric.stateless_update_state(these, y, y_pred)
            logs[metric.name] = metric.stateless_result(these)
            new_metrics_vars += these
        return logs, (trainable, non_trainable, opt_vars, new_metrics_vars)


def build(p: Program, pin: bool) -> keras.Model:
    inputs, outputs = _body(p, pin)
    cls = GuideTrainStep if p.path == "train_step" else keras.Model
    return cls(inputs, outputs, name=f"prog{p.seed}")
