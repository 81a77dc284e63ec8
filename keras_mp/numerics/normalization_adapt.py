"""Keras' `Normalization.adapt` under a float16 or bfloat16 compute dtype.

Under Keras' global `"mixed_float16"` a `keras.layers.Normalization()` computes in float16,
and Keras' `adapt` then fails on a dataset or a list of batches (it adds float16 batch
statistics to float32 running ones: `InvalidArgumentError ... AddV2`); on a NumPy array it
succeeds, but a mean or variance past 65,504 becomes `inf` and every output `NaN`, silently.

`install()` (done by `import keras_mp`) wraps `Normalization.adapt`: the statistics are
gathered in float32 (the layer's own variables are float32 anyway) and then cast to the
layer's compute dtype as Keras does; where the adapted data reach past that dtype's range
(|mean| + 4 std > 65,504 in float16), a warning names the layer and the fix: make it with
`dtype="float32"` (it then computes in float32; `kmp.convert` keeps it so), or build and
adapt it under float32 and `kmp.convert` the model (its keep-list runs `Normalization` in
float32). A layer that computes in float32 is adapted exactly as Keras does it.
"""

from __future__ import annotations

import functools
import warnings

import keras

__all__ = ["install", "installed", "uninstall"]

_FLAG = "_keras_mp_adapt"


def _adapt_in_float32(original, layer, data) -> None:
    saved = layer._dtype_policy
    layer._dtype_policy = keras.DTypePolicy("float32")
    try:
        original(layer, data)
    finally:
        layer._dtype_policy = saved
    layer.finalize_state()  # mean and variance in the layer's own compute dtype


def _warn_if_out_of_range(layer) -> None:
    largest = {"float16": 65504.0}.get(layer.compute_dtype)
    if largest is None or getattr(layer, "adapt_mean", None) is None:
        return
    peak = _peak(layer)
    if peak is None or peak <= largest:
        return
    warnings.warn(
        f"Normalization layer {layer.name!r} computes in {layer.compute_dtype} but was adapted "
        f"on data reaching about {peak:.3g} (|mean| + 4 std), past {layer.compute_dtype}'s "
        f"largest value {largest:g}: its inputs overflow and its outputs are inf/NaN. Make it "
        "with keras.layers.Normalization(dtype='float32') (it computes in float32, its output "
        "goes on in the compute dtype; kmp.convert keeps it float32), or build and adapt it "
        "under float32 and kmp.convert the model.",
        UserWarning,
        stacklevel=3,
    )


def _peak(layer) -> float | None:
    """`max(|mean| + 4 std)` from the layer's float32 adapted variables (before the cast to
    its compute dtype turns them to inf)."""
    import numpy as np

    mean = np.asarray(keras.ops.convert_to_numpy(layer.adapt_mean), np.float64)
    variance = np.asarray(keras.ops.convert_to_numpy(layer.adapt_variance), np.float64)
    peak = np.abs(mean) + 4 * np.sqrt(np.abs(variance))
    return float(np.max(peak)) if peak.size else None


def install() -> None:
    """Wraps `keras.layers.Normalization.adapt` (see the module docstring); idempotent."""
    original = keras.layers.Normalization.adapt
    if getattr(original, _FLAG, False):
        return

    @functools.wraps(original)
    def adapt(self, data):
        if self.compute_dtype in ("float32", "float64"):
            return original(self, data)
        _adapt_in_float32(original, self, data)
        _warn_if_out_of_range(self)
        return None

    setattr(adapt, _FLAG, True)
    keras.layers.Normalization.adapt = adapt


def uninstall() -> None:
    """Gives `keras.layers.Normalization` its own `adapt` back; idempotent."""
    current = keras.layers.Normalization.adapt
    if getattr(current, _FLAG, False):
        keras.layers.Normalization.adapt = current.__wrapped__


def installed() -> bool:
    """Whether `keras.layers.Normalization.adapt` is keras_mp's (see the module docstring)."""
    return bool(getattr(keras.layers.Normalization.adapt, _FLAG, False))
