"""Changing the dtype of a model's variables in place, the `Variable` objects kept.

Used when a model is converted (`recast_variables`: every weight to its layer's variable
dtype) and when a model built under a keras_mp policy is compiled (`float32_statistics`:
normalization statistics back to float32).
"""

from __future__ import annotations

import keras
import numpy as np

__all__ = ["float32_statistics", "host_value", "own_variables", "recast_variables"]


def own_variables(layer) -> list:
    """The variables `layer` creates itself (not its sublayers')."""
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def recast_variables(model: keras.Model, trainable_only: bool = False) -> int:
    """Gives every float variable its layer's variable dtype, in place.

    For a model whose layers' policies changed after their variables were made (a pure
    float16/bfloat16 policy given to a float32 model): each floating variable whose dtype
    differs from its layer's `variable_dtype` is re-created in that dtype, values rounded,
    the `Variable` object kept (every reference to it stays valid).

    Args:
        model: A built model.
        trainable_only: recast only the variables their layer made trainable, frozen or
            not (`lean_bfloat16`: statistics such as BatchNormalization's moving mean and
            variance stay float32, their slow averages would stall in bfloat16; a frozen
            base's kernels become bfloat16 as its layers compute, and train as lean
            weights once unfrozen).

    Returns:
        The number of variables recast.
    """
    count = 0
    for layer in model._flatten_layers(include_self=True):
        want = layer.variable_dtype
        weights = {id(v) for v in layer._trainable_variables}  # frozen ones included
        for variable in own_variables(layer):
            if not keras.backend.is_float_dtype(variable.dtype) or variable.dtype == want:
                continue
            if trainable_only and id(variable) not in weights:
                continue
            _recast(variable, want, weight=id(variable) in weights)
            count += 1
    return count


def float32_statistics(model: keras.Model) -> int:
    """Re-creates the model's non-trainable low-precision float variables (normalization
    statistics) in float32, in place, the `Variable` objects kept. Returns how many."""
    count = 0
    for layer in model._flatten_layers(include_self=True):
        # statistics are made non-trainable; a frozen layer's weights are not statistics
        for variable in layer._non_trainable_variables:
            dtype = keras.backend.standardize_dtype(variable.dtype)
            if dtype not in ("float16", "bfloat16"):
                continue
            _recast(variable, "float32")
            count += 1
    return count


def host_value(x) -> np.ndarray:
    """A Keras variable's value, or a tensor, as a NumPy array, without NumPy 2's warning.

    `keras.ops.convert_to_numpy` calls `np.array` on TensorFlow's variables and tensors,
    whose `__array__` takes no `copy` argument: NumPy 2 raises a DeprecationWarning, an
    error under `python -W error`. TensorFlow's own `numpy()` copies the value without it.

    Args:
        x: a `keras.Variable`, a backend tensor, or anything `np.asarray` takes.

    Returns:
        A NumPy array (bfloat16 as `ml_dtypes.bfloat16`).
    """
    value = x.value if isinstance(x, keras.Variable) else x
    if keras.backend.backend() == "tensorflow" and hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(keras.ops.convert_to_numpy(value))


def _recast(variable, want: str, weight: bool = False) -> None:
    if getattr(variable, "_value", True) is None and getattr(variable, "_initializer", None):
        variable._dtype = want  # unmaterialised (a StatelessScope without initialisation)
        return
    value = keras.ops.cast(host_value(variable), want)
    variable._dtype = want
    # A weight of a frozen layer is re-made as trainable as it was made: TensorFlow's tape
    # watches only variables made trainable, and unfreezing sets Keras' flag alone.
    frozen = weight and not variable.trainable
    if frozen:
        variable.trainable = True
    try:
        variable._initialize(variable._convert_to_tensor(value, dtype=want))
    finally:
        if frozen:
            variable.trainable = False
