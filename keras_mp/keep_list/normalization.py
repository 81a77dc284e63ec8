"""Keras' `Normalization` preprocessing layer: why the keep-list runs it in float32.

It is the one Keras normalization layer that sees the user's raw data: adapted on values of
1e4-1e5 (prices, populations, timestamps), its input overflows float16 (largest 65,504) and
keeps 8 significant bits in bfloat16 (a value of 5e4 moves in steps of 256), before its
mean is subtracted. Computing it in float32 costs nothing (element-wise, at the input), and
its normalised output is safe in the low dtype. `"normalization"` pins it; `adapted_peak`
reads its adapted state, so the plan can say how far past the low dtype's range it reaches.

Nothing here imports the rest of keras_mp.
"""

from __future__ import annotations

import keras
import numpy as np

__all__ = ["adapted_peak", "plan_note"]

_LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}


def adapted_peak(layer: keras.layers.Layer) -> float | None:
    """`max(|mean| + 4 * std)` over the features of an adapted (or given) `Normalization`
    layer: about the largest value it will see; None for other layers or unbuilt ones."""
    if not isinstance(layer, keras.layers.Normalization) or not layer.built:
        return None
    mean, variance = getattr(layer, "mean", None), getattr(layer, "variance", None)
    if mean is None or variance is None:
        return None
    mean = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(mean, "float32")), np.float64)
    std = np.sqrt(
        np.abs(np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(variance, "float32"))))
    )
    peak = np.abs(mean) + 4 * std
    return float(np.max(peak)) if peak.size else None


def plan_note(layer: keras.layers.Layer, address: str, compute_dtype: str) -> str | None:
    """A plan note for a `Normalization` layer whose data would leave `compute_dtype`'s
    range, or None."""
    peak = adapted_peak(layer)
    largest = _LARGEST.get(compute_dtype)
    if peak is None or largest is None:
        return None
    if not np.isfinite(peak):
        return (
            f"{address!r} (Normalization): its adapted mean/variance are not finite: adapt it "
            "again in float32 (make it with dtype='float32', or adapt before setting a "
            "mixed global policy)."
        )
    if peak <= largest:
        return None
    return (
        f"{address!r} (Normalization): adapted on data reaching about {peak:.3g} "
        f"(|mean| + 4 std), past {compute_dtype}'s largest value {largest:g}: pinned to "
        "float32, its inputs would overflow; its normalised output goes on in "
        f"{compute_dtype}."
    )
