"""Seeded user programs: what a user writes around keras_mp, small enough to train in seconds.

A `Program` is a frozen description (model family, how the precision is set, loss, weighting,
optimizer, training path, event, seed). `generate(seed, backend)` draws one; `run(program,
precision)` builds and trains it, under its own precision setup or under `"float32"` (the
reference: the same program with no policy anywhere), and returns a `Run`: the loss per
epoch, the warnings seen, the exception if any, and facts read off the trained model.

Only public API is used: `keras`, `keras_mp` (as a user imports it) and numpy, plus
TensorFlow / JAX in the paths written the way Keras' guides write them.

Example:

```python
from tests.harness import programs
p = programs.generate(7, "tensorflow")
print(p.describe())           # family=dense policy=convert:mixed_float16 ...
low, ref = programs.run(p), programs.run(p, precision="float32")
```
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import traceback
import warnings
from typing import Any

import keras
import numpy as np
from keras import ops

import keras_mp as kmp

__all__ = [
    "FAMILIES",
    "POLICIES",
    "Program",
    "Run",
    "generate",
    "run",
]

FAMILIES = (
    "dense",
    "conv_bn",
    "rnn_mask",
    "attention",
    "emb_int",
    "emb_float",
    "custom",
    "shared",
    "frozen",
    "preprocess",
    "added_loss",
    "multi_io",
)
# How the user sets the precision:
#   convert:P        kmp.convert(float32 model, P)
#   keras:P          keras.mixed_precision.set_global_policy(P) before building (Keras' names)
#   kmp:P            kmp.set_global_policy(P) before building
#   pin:P            a layer built with dtype="float32", then kmp.convert(model, P)
#   twice:P>Q        kmp.convert(kmp.convert(model, P), Q)
#   keras16>convert:Q  built under Keras' global mixed_float16, then kmp.convert(model, Q)
POLICIES = (
    "convert:mixed_float16",
    "convert:mixed_bfloat16",
    "convert:lean_bfloat16",
    "keras:mixed_float16",
    "keras:mixed_bfloat16",
    "keras:float16",
    "keras:bfloat16",
    "kmp:mixed_float16",
    "kmp:mixed_bfloat16",
    "pin:mixed_float16",
    "twice:mixed_float16>mixed_bfloat16",
    "keras16>convert:mixed_bfloat16",
)
LOSSES = ("keras_sparse", "kmp_sparse", "keras_onehot", "kmp_onehot", "keras_ignore", "kmp_ignore")
WEIGHTINGS = ("none", "sample", "class")
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")
WRAPS = ("plain", "kmp", "keras_lso")
CLIPS = ("none", "clipnorm", "global_clipnorm")
PATHS = ("fit", "train_step", "tape", "jax_loop")
JITS = ("auto", "true", "false")
EVENTS = ("none", "nan_sample", "bad_label", "high_lr", "save_load", "small_grad")
SMALL_GRAD = 1e-5  # "small_grad" (not drawn; the oracle's own check): sample weights this small

CLASSES = 4
N, BATCH, EPOCHS = 48, 16, 5  # 3 steps per epoch, 15 steps
LR = {"adam": 1e-2, "adamw": 1e-2, "sgd": 5e-2, "rmsprop": 5e-3}
HIGH_LR = 1e3
KMP_DIR = os.path.dirname(kmp.__file__) + os.sep


@dataclasses.dataclass(frozen=True)
class Program:
    """One generated user program; `describe()` is its one-line, parseable spelling."""

    seed: int
    family: str = "dense"
    policy: str = "convert:mixed_float16"
    loss: str = "keras_sparse"
    weight: str = "none"
    opt: str = "adam"
    wrap: str = "plain"
    clip: str = "none"
    path: str = "fit"
    jit: str = "auto"
    event: str = "none"

    def describe(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    @classmethod
    def parse(cls, text: str) -> Program:
        """The inverse of `describe()` (missing keys take the defaults)."""
        kw: dict[str, Any] = dict(item.split("=", 1) for item in text.split())
        kw["seed"] = int(kw["seed"])
        return cls(**kw)

    @property
    def low_dtype(self) -> str:
        """The low-precision format the program runs in: float16, bfloat16 or lean."""
        target = self.policy.split(":")[-1].split(">")[-1]
        if "lean" in target:
            return "lean"
        return "float16" if "float16" in target and "bfloat16" not in target else "bfloat16"

    @property
    def ref_key(self) -> tuple:
        """What the float32 reference depends on (the policy does not)."""
        return dataclasses.replace(self, policy="float32", wrap="plain").describe()


def generate(seed: int, backend: str | None = None) -> Program:
    """Draws a consistent program from `seed` (the same program for the same seed/backend)."""
    backend = backend or keras.backend.backend()
    rng = np.random.default_rng([seed, 52])
    pick = lambda xs: xs[int(rng.integers(len(xs)))]
    family = FAMILIES[seed % len(FAMILIES)]
    policy = POLICIES[(seed // len(FAMILIES) + seed) % len(POLICIES)]
    paths = ["fit"] * 4 + ["train_step", "tape" if backend == "tensorflow" else "jax_loop"]
    path = pick(paths)
    loss = pick(LOSSES)
    weight = pick(("none", "none", "sample", "class")) if path == "fit" else "none"
    if family == "multi_io" and weight == "class":
        weight = "sample"  # Keras: class_weight is for single-output models
    if family in ("rnn_mask", "attention") and weight == "class":
        weight = "none"
    event = pick(("none",) * 5 + ("nan_sample", "bad_label", "high_lr", "save_load"))
    if event == "bad_label" and "onehot" in loss:
        loss = loss.replace("onehot", "sparse")
    if event == "save_load" and path != "fit":
        path = "fit"
    return Program(
        seed=seed,
        family=family,
        policy=policy,
        loss=loss,
        weight=weight,
        opt=pick(OPTIMIZERS),
        wrap=pick(("plain", "plain", "kmp", "keras_lso")),
        clip=pick(("none", "none", "clipnorm", "global_clipnorm")),
        path=path,
        jit=pick(("auto", "auto", "true", "false")),
        event=event,
    )


# ---------------------------------------------------------------------------- data


def _data(p: Program) -> tuple[Any, Any]:
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


def _event_data(p: Program, x, y):
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


def _targets(p: Program, y):
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
        x, _ = _data(p)
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


def _build(p: Program, pin: bool) -> keras.Model:
    inputs, outputs = _body(p, pin)
    cls = GuideTrainStep if p.path == "train_step" else keras.Model
    return cls(inputs, outputs, name=f"prog{p.seed}")


# ---------------------------------------------------------------------------- training


def _loss(p: Program):
    kind, _, variant = p.loss.partition("_")
    lib = kmp.losses if kind == "kmp" else keras.losses
    if variant == "onehot":
        return lib.CategoricalCrossentropy(from_logits=True)
    kw = {"ignore_class": 0} if variant == "ignore" else {}
    return lib.SparseCategoricalCrossentropy(from_logits=True, **kw)


def _optimizer(p: Program, precision: str):
    lr = HIGH_LR if p.event == "high_lr" else LR[p.opt]
    kw = {"clipnorm": 1.0} if p.clip == "clipnorm" else {}
    if p.clip == "global_clipnorm":
        kw = {"global_clipnorm": 1.0}
    opts = keras.optimizers
    opt = {
        "adam": lambda: opts.Adam(lr, **kw),
        "adamw": lambda: opts.AdamW(lr, weight_decay=1e-3, **kw),
        "sgd": lambda: opts.SGD(lr, momentum=0.9, **kw),
        "rmsprop": lambda: opts.RMSprop(lr, **kw),
    }[p.opt]()
    if precision == "float32" or p.wrap == "plain":
        return opt
    if p.wrap == "keras_lso":
        return opts.LossScaleOptimizer(opt)
    if p.low_dtype == "lean":
        return kmp.LeanOptimizer(opt)
    return kmp.LossScaleOptimizer(opt)


def _apply_precision(p: Program, precision: str):
    """Builds the program's model under its precision setup. Returns the model."""
    if precision == "float32":
        return _build(p, pin=False)
    how, _, target = p.policy.partition(":")
    if how == "keras16>convert":
        keras.mixed_precision.set_global_policy("mixed_float16")
        model = _build(p, pin=False)
        keras.mixed_precision.set_global_policy("float32")
        return kmp.convert(model, target)
    if how == "keras":
        keras.mixed_precision.set_global_policy(target)
        return _build(p, pin=False)
    if how == "kmp":
        kmp.set_global_policy(target)
        return _build(p, pin=False)
    if how == "twice":
        first, second = target.split(">")
        return kmp.convert(kmp.convert(_build(p, pin=False), first), second)
    return kmp.convert(_build(p, pin=how == "pin"), target)


def _reset_precision():
    keras.mixed_precision.set_global_policy("float32")
    kmp.set_global_policy("float32")


def _loss_of(p: Program, loss_fn, y, pred, model, sample_weight=None):
    """The loss a user's own loop computes: per output, plus `model.losses`."""
    if isinstance(pred, dict):
        total = sum(loss_fn(y[k], pred[k], sample_weight=sample_weight) for k in sorted(pred))
    else:
        total = loss_fn(y, pred, sample_weight=sample_weight)
    return total


def _batches(x, y, sw):
    take = lambda d, s: (
        {k: v[s] for k, v in d.items()} if isinstance(d, dict) else (None if d is None else d[s])
    )
    for start in range(0, N, BATCH):
        s = slice(start, start + BATCH)
        yield take(x, s), take(y, s), take(sw, s)


def _tape_loop(p, model, opt, loss_fn, x, y, sw) -> list[float]:
    """Keras' "Writing a training loop from scratch" (TensorFlow), as written there."""
    import tensorflow as tf

    def step(xb, yb, swb):
        with tf.GradientTape() as tape:
            pred = model(xb, training=True)
            loss = _loss_of(p, loss_fn, yb, pred, model, swb)
            if model.losses:
                loss += sum(model.losses)
        grads = tape.gradient(loss, model.trainable_weights)
        opt.apply(grads, model.trainable_weights)
        return loss

    step = tf.function(step, jit_compile={"true": True, "false": False}.get(p.jit))
    history = []
    for _ in range(EPOCHS):
        losses = [float(step(*b)) for b in _batches(x, y, sw)]
        history.append(float(np.mean(losses)))
    return history


def _jax_loop(p, model, opt, loss_fn, x, y, sw) -> list[float]:
    """Keras' "Writing a training loop from scratch in JAX", as written there."""
    import jax

    def compute_loss_and_updates(trainable, non_trainable, xb, yb, swb):
        pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, xb, training=True, return_losses=True
        )
        loss = _loss_of(p, loss_fn, yb, pred, model, swb)
        if losses:
            loss += sum(losses)
        return loss, non_trainable

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    def train_step(state, data):
        trainable, non_trainable, opt_vars = state
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, *data)
        trainable, opt_vars = opt.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    if p.jit != "false":
        train_step = jax.jit(train_step)
    opt.build(model.trainable_variables)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in opt.variables],
    )
    history = []
    for _ in range(EPOCHS):
        losses = []
        for b in _batches(x, y, sw):
            loss, state = train_step(state, b)
            losses.append(float(loss))
        history.append(float(np.mean(losses)))
    for var, value in zip(model.trainable_variables, state[0]):
        var.assign(value)
    for var, value in zip(model.non_trainable_variables, state[1]):
        var.assign(value)
    for var, value in zip(opt.variables, state[2]):
        var.assign(value)
    return history


def _fit(p, model, opt, loss_fn, x, y, sw, epochs=EPOCHS, compile=True, initial_epoch=0):
    if compile:
        jit = {"true": True, "false": False}.get(p.jit, "auto")
        loss = {k: loss_fn for k in ("out1", "out2")} if p.family == "multi_io" else loss_fn
        model.compile(optimizer=opt, loss=loss, jit_compile=jit)
    kw = {}
    if p.weight == "sample":
        kw["sample_weight"] = sw
    if p.weight == "class":
        kw["class_weight"] = {0: 1.0, 1: 2.0, 2: 0.5, 3: 1.0}
    h = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        **kw,
    )
    return [float(v) for v in h.history["loss"]]


@dataclasses.dataclass
class Run:
    """What one run of a program gave."""

    precision: str
    losses: list[float] = dataclasses.field(default_factory=list)
    weights_finite: bool = True
    warnings: list[tuple[str, str, bool]] = dataclasses.field(default_factory=list)
    error: dict | None = None  # type, message, frames [(file, line, func, text)]
    facts: dict = dataclasses.field(default_factory=dict)
    uninterrupted: list[float] | None = None  # save_load: the same run without the reload

    def kmp_warnings(self) -> list[str]:
        return [m for _, m, ours in self.warnings if ours]


class _WarningLog:
    """Records every warning with whether keras_mp's code issued it (the frame that called
    `warnings.warn`, found on the stack, is under keras_mp/; `stacklevel` cannot hide it)."""

    def __init__(self):
        self.seen: list[tuple[str, str, bool]] = []
        self._cm = warnings.catch_warnings()

    def __enter__(self):
        self._cm.__enter__()
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.showwarning = self._show
        return self

    def _show(self, message, category, filename, lineno, file=None, line=None):
        frame, ours = sys._getframe(1), False
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.endswith(("warnings.py", "harness/programs.py")):
                ours = name.startswith(KMP_DIR) or filename.startswith(KMP_DIR)
                break
            frame = frame.f_back
        self.seen.append((category.__name__, str(message), ours))

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def _error_of(e: BaseException) -> dict:
    """The exception as data: type, message, traceback frames, and the keras_mp sites a
    TensorFlow graph error names as where its failing op was defined."""
    frames = [
        (f.filename, f.lineno, f.name, (f.line or "").strip())
        for f in traceback.extract_tb(e.__traceback__)
    ]
    message = str(e)
    sites = re.findall(r"File \"([^\"]*keras_mp[^\"]*)\", line (\d+)", message)
    return {
        "type": type(e).__name__,
        "module": type(e).__module__,
        "message": message[:4000],
        "frames": frames,
        "graph_sites": [(path, int(line)) for path, line in sites if path.startswith(KMP_DIR)],
    }


def _layers(layer, seen=None):
    """Every layer inside `layer` (sub-models, and a custom layer's attribute sublayers),
    walked with public attributes only."""
    seen = set() if seen is None else seen
    if id(layer) in seen:
        return
    seen.add(id(layer))
    yield layer
    children = list(getattr(layer, "layers", []) or [])
    children += [v for v in vars(layer).values() if isinstance(v, keras.layers.Layer)]
    for child in children:
        yield from _layers(child, seen)


def _facts(p: Program, model, opt) -> dict:
    """What the oracle checks besides the numbers: dtypes where the setup says what they
    must be, and the trainable weights."""
    facts = {
        "trainable": len(model.trainable_weights),
        "optimizer": type(opt).__name__ if opt is not None else None,
        "dynamic_scale": getattr(getattr(opt, "loss_scale_config", None), "dynamic", None),
        "compute_dtypes": sorted({layer.compute_dtype for layer in _layers(model)}),
    }
    pinned = [layer for layer in _layers(model) if layer.name == "pinned"]
    if pinned:
        facts["pinned"] = pinned[0].compute_dtype
    facts["input_policies"] = sorted(
        {
            layer.dtype_policy.name
            for layer in _layers(model)
            if isinstance(layer, keras.layers.InputLayer)
        }
    )
    return facts


def run(p: Program, precision: str = "low", init_seed: int | None = None) -> Run:
    """Builds and trains `p` under its own setup (`precision="low"`) or in float32.

    `init_seed` reseeds the weights (the float32-vs-float32 calibration). Never raises:
    an exception becomes `Run.error`.
    """
    result = Run(precision=precision)
    keras.backend.clear_session()
    # Keras trims its own frames from tracebacks (a setting `clear_session` resets); the
    # oracle needs them all to tell a deliberate `raise` from an error deeper down
    keras.config.disable_traceback_filtering()
    _reset_precision()
    keras.utils.set_random_seed(p.seed if init_seed is None else init_seed)
    x, y = _data(p)
    x, y = _event_data(p, x, y)
    y = _targets(p, y)
    sw = np.random.default_rng([p.seed, 3]).uniform(0.5, 1.5, N).astype("float32")
    if p.event == "small_grad":
        sw *= SMALL_GRAD
    model = opt = None
    with _WarningLog() as log:
        try:
            model = _apply_precision(p, precision)
            opt = _optimizer(p, precision)
            loss_fn = _loss(p)
            if p.path == "tape":
                result.losses = _tape_loop(p, model, opt, loss_fn, x, y, _sw(p, sw))
            elif p.path == "jax_loop":
                result.losses = _jax_loop(p, model, opt, loss_fn, x, y, _sw(p, sw))
            elif p.event == "save_load":
                first = _fit(p, model, opt, loss_fn, x, y, sw, epochs=2)
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "model.keras")
                    kmp.saving.save_model(model, path)
                    model = kmp.saving.load_model(path)
                    opt = model.optimizer
                result.losses = first + _fit(
                    p, model, opt, loss_fn, x, y, sw, compile=False, initial_epoch=2
                )
            else:
                result.losses = _fit(p, model, opt, loss_fn, x, y, sw)
            result.weights_finite = all(
                bool(np.all(np.isfinite(np.asarray(keras.ops.convert_to_numpy(w), "float32"))))
                for w in model.weights
                if "float" in str(w.dtype)
            )
            result.facts = _facts(p, model, getattr(model, "optimizer", None) or opt)
        except Exception as e:  # noqa: BLE001 - the oracle classifies it
            result.error = _error_of(e)
            if model is not None:
                try:
                    result.facts = _facts(p, model, opt)
                except Exception:  # noqa: BLE001
                    pass
        finally:
            _reset_precision()
    result.warnings = log.seen
    if p.event == "save_load" and precision != "float32" and result.error is None:
        whole = run(dataclasses.replace(p, event="none"), precision, init_seed)
        result.uninterrupted = whole.losses if whole.error is None else None
    return result


def _sw(p: Program, sw):
    return sw if p.weight == "sample" else None
