"""Moving averages of lean (bfloat16) weights that move: `ema_update`.

keras.io's DDIM keeps `ema_network = keras.models.clone_model(network)` and updates
`ema_w.assign(ema * ema_w + (1 - ema) * w)`. A clone of a `lean_bfloat16` model has
bfloat16 weights, so that update runs in bfloat16: with `ema = 0.999` a step of
`0.001 * (w - ema_w)` is below half a bfloat16 ulp and rounds away, and the average never
moves (100 steps: 0.000 of the way, float32: 0.095). `ema_update` does the arithmetic in
float32 and writes a bfloat16 average back with the lean optimizer's unbiased stochastic
rounding (`codecs.stochastic_round_bfloat16`, 16 random bits), so the average moves by
the right amount on average; float32 (and float16) averages are written as computed.

Where keras_mp sees such a copy made, it says so: `install()` (done by `import keras_mp`,
`keras_mp/keras_glue/patches.py`) wraps `keras.models.clone_model` to warn once when the
model cloned has bfloat16 trainable weights, naming `ema_update` and the float32 copy.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import keras
from keras import ops

from keras_mp.lean import codecs

__all__ = ["CLONE_MESSAGE", "ema_update", "install", "installed", "uninstall"]

_SEED: list = []
_FLAG = "_keras_mp_clone_warning"

CLONE_MESSAGE = (
    "keras.models.clone_model: {name!r} has bfloat16 weights, and so has its clone. A "
    "moving average (EMA, SWA, a teacher) kept in it and updated with `assign` runs in "
    "bfloat16, which rounds small updates away (decay 0.999: it never moves). Update it "
    "with `kmp.lean.ema_update(clone, model, decay)` (float32 math, stochastic rounding), "
    "or keep the copy in float32: `kmp.convert(clone, 'float32')`. "
    "See docs/custom-training.md."
)


def _variables(x: Any, what: str) -> list:
    if isinstance(x, keras.layers.Layer):
        return list(x.weights)
    try:
        return list(x)
    except TypeError:
        raise TypeError(
            f"ema_update: `{what}` must be a model/layer or a list of variables, got "
            f"{type(x).__name__}."
        ) from None


def ema_update(
    averages: Any,
    values: Any,
    decay: float,
    seed: keras.random.SeedGenerator | None = None,
) -> None:
    """`average = decay * average + (1 - decay) * value`, for each pair, in float32.

    Args:
        averages: the moving-average copy: a model or layer (its `weights`) or a list of
            variables. bfloat16 ones are written with unbiased stochastic rounding.
        values: the trained model (or list of variables), paired in order with
            `averages`.
        decay: in [0, 1] (keras.io's DDIM: 0.999).
        seed: the `keras.random.SeedGenerator` of the roundings' noise (default: one
            made on first use).

    Example:

    >>> ema_network = kmp.convert(network, "lean_bfloat16")  # doctest: +SKIP
    >>> kmp.lean.ema_update(ema_network, network, 0.999)  # after each step  # doctest: +SKIP
    """
    if not 0.0 <= float(decay) <= 1.0:
        raise ValueError(f"ema_update: `decay` must lie in [0, 1], got {decay!r}.")
    targets, sources = _variables(averages, "averages"), _variables(values, "values")
    if len(targets) != len(sources):
        raise ValueError(
            f"ema_update: `averages` has {len(targets)} variables and `values` "
            f"{len(sources)}: pass a copy of the same model."
        )
    if seed is None:
        if not _SEED:
            _SEED.append(keras.random.SeedGenerator(0))
        seed = _SEED[0]
    for target, source in zip(targets, sources):
        if tuple(target.shape) != tuple(source.shape):
            raise ValueError(
                f"ema_update: {target.path!r} has shape {tuple(target.shape)} and "
                f"{source.path!r} {tuple(source.shape)}: pass a copy of the same model."
            )
        if not keras.backend.is_float_dtype(target.dtype):
            target.assign(source.value)  # counters (a BatchNorm's are floats anyway)
            continue
        average = ops.cast(target.value, "float32")
        new = average + (ops.cast(source.value, "float32") - average) * (1.0 - float(decay))
        if keras.backend.standardize_dtype(target.dtype) == "bfloat16":
            bits = keras.random.randint(tuple(target.shape), 0, 65536, dtype="int32", seed=seed)
            target.assign(codecs.stochastic_round_bfloat16(new, bits))
        else:
            target.assign(ops.cast(new, target.dtype))


def _warning(clone_model):
    @functools.wraps(clone_model)
    def clone_model_warning_on_bfloat16(model, *args, **kwargs):
        copy = clone_model(model, *args, **kwargs)
        weights = getattr(model, "trainable_weights", [])
        if any(keras.backend.standardize_dtype(v.dtype) == "bfloat16" for v in weights):
            warnings.warn(CLONE_MESSAGE.format(name=model.name), UserWarning, stacklevel=2)
        return copy

    setattr(clone_model_warning_on_bfloat16, _FLAG, True)
    return clone_model_warning_on_bfloat16


def installed() -> bool:
    """Whether `keras.models.clone_model` warns about bfloat16 copies."""
    return bool(getattr(keras.models.clone_model, _FLAG, False))


def install() -> None:
    """Makes `keras.models.clone_model` warn when it copies a model with bfloat16 weights
    (an average kept in the copy would stall); idempotent."""
    if not installed():
        keras.models.clone_model = _warning(keras.models.clone_model)


def uninstall() -> None:
    """Gives `keras.models.clone_model` back; idempotent."""
    if installed():
        keras.models.clone_model = keras.models.clone_model.__wrapped__
