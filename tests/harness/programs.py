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
print(p.describe())           # seed=7 family=shared policy=kmp:mixed_float16 ...
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

import keras_mp as kmp

from . import families
from .families import N
from .loops import BATCH, EPOCHS, jax_loop, tape_loop

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
        return families.build(p, pin=False)
    how, _, target = p.policy.partition(":")
    if how == "keras16>convert":
        keras.mixed_precision.set_global_policy("mixed_float16")
        model = families.build(p, pin=False)
        keras.mixed_precision.set_global_policy("float32")
        return kmp.convert(model, target)
    if how == "keras":
        keras.mixed_precision.set_global_policy(target)
        return families.build(p, pin=False)
    if how == "kmp":
        kmp.set_global_policy(target)
        return families.build(p, pin=False)
    if how == "twice":
        first, second = target.split(">")
        return kmp.convert(kmp.convert(families.build(p, pin=False), first), second)
    return kmp.convert(families.build(p, pin=how == "pin"), target)


def _reset_precision():
    keras.mixed_precision.set_global_policy("float32")
    kmp.set_global_policy("float32")


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
        # head and tail: a graph error's own text (an assertion's message) comes last,
        # after the traceback of where the op was defined, which pytest makes long
        "message": message if len(message) <= 4000 else f"{message[:2000]}\n...\n{message[-2000:]}",
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
    x, y = families.data(p)
    x, y = families.event_data(p, x, y)
    y = families.targets(p, y)
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
                result.losses = tape_loop(p, model, opt, loss_fn, x, y, _sw(p, sw))
            elif p.path == "jax_loop":
                result.losses = jax_loop(p, model, opt, loss_fn, x, y, _sw(p, sw))
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
