"""Moving averages of lean (bfloat16) weights that move: `ema_update`.

keras.io's DDIM keeps `ema_network = keras.models.clone_model(network)` and updates
`ema_w.assign(ema * ema_w + (1 - ema) * w)`. A clone of a `lean_bfloat16` model has
bfloat16 weights, so that update runs in bfloat16: with `ema = 0.999` a step of
`0.001 * (w - ema_w)` is below half a bfloat16 ulp and rounds away, and the average never
moves (100 steps: 0.000 of the way, float32: 0.095). `ema_update` does the arithmetic in
float32 and writes a bfloat16 average back with the lean optimizer's unbiased stochastic
rounding (`codecs.stochastic_round_bfloat16`, 16 random bits), so the average moves by
the right amount on average; float32 (and float16) averages are written as computed.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from keras_mp.lean import codecs

__all__ = ["ema_update"]

_SEED: list = []


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
