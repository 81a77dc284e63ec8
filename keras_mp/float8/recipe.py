"""The float8 recipe (delayed per-tensor scaling) and the dtype policy that carries it.

`Float8Recipe` is in the manner of Transformer Engine's `DelayedScaling`: margin, history
length, "max"/"most_recent" amax, HYBRID (E4M3 forward, E5M2 backward) or all-E4M3.
`Float8DTypePolicy` is Keras' float8 dtype policy carrying a recipe; the layers that run it
are in `keras_mp.float8.layers`.

Scale conventions: `compute_scale` returns Transformer Engine's scale,
`fp8_max / amax / 2**margin` (values are multiplied by it before the cast to FP8); the
Keras variables (`inputs_scale`, `kernel_scale`, `outputs_grad_scale`) hold its reciprocal
(values are divided by them). The history's entry 0 is the newest amax.
"""

from __future__ import annotations

import dataclasses

import keras
import ml_dtypes
import numpy as np
from keras import ops
from keras.dtype_policies import QuantizedFloat8DTypePolicy

__all__ = ["Float8DTypePolicy", "Float8Recipe", "as_recipe", "compute_scale"]

_ALGOS = ("max", "most_recent")
_FORMATS = ("HYBRID", "E4M3")
_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_TENSORS = ("inputs", "kernel", "outputs_grad")


@keras.saving.register_keras_serializable(package="keras_mp")
@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How FP8 scales are derived, like Transformer Engine's `DelayedScaling`.

    Each FP8 tensor (a layer's inputs, its kernel, its output gradient) keeps a history
    of its last `amax_history_len` absolute maxima. Before each step's cast the tensor is
    multiplied by `scale = fp8_max / amax / 2**margin`, where `amax` is the maximum of the
    history (`"max"`) or its newest entry (`"most_recent"`); the scale used at step t is
    computed from the history up to step t-1 (delayed scaling).

    Args:
        margin: Non-negative integer; the scale is divided by `2**margin` to leave
            headroom for growing values.
        amax_history_len: Length of the amax history window (>= 1).
        amax_compute_algo: `"max"` (over the window) or `"most_recent"`.
        fp8_format: `"HYBRID"` (E4M3 for inputs and kernels, E5M2 for the output
            gradients: Keras' default) or `"E4M3"` (E4M3 everywhere).

    Example:

    ```python
    recipe = kmp.float8.Float8Recipe(margin=1, amax_history_len=16)
    kmp.float8.apply_float8(model, recipe)
    ```
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_format: str = "HYBRID"

    def __post_init__(self):
        def check(name, ok, valid):
            if not ok:
                raise ValueError(
                    f"Float8Recipe: invalid `{name}`={getattr(self, name)!r}. Valid: {valid}."
                )

        def is_int(v):
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        check("margin", is_int(self.margin) and self.margin >= 0, "an integer >= 0")
        check(
            "amax_history_len",
            is_int(self.amax_history_len) and self.amax_history_len >= 1,
            "an integer >= 1",
        )
        check("amax_compute_algo", self.amax_compute_algo in _ALGOS, list(_ALGOS))
        check("fp8_format", self.fp8_format in _FORMATS, list(_FORMATS))

    @property
    def gradient_dtype(self) -> str:
        """The FP8 dtype of the output gradients: `float8_e5m2` (HYBRID) or `float8_e4m3fn`."""
        return "float8_e5m2" if self.fp8_format == "HYBRID" else "float8_e4m3fn"

    def get_config(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_config(cls, config: dict) -> Float8Recipe:
        return cls(**config)


def as_recipe(recipe) -> Float8Recipe:
    """`recipe` as a `Float8Recipe`: None gives the default, a dict its config."""
    if recipe is None:
        return Float8Recipe()
    if isinstance(recipe, dict):
        return Float8Recipe.from_config(recipe)
    if not isinstance(recipe, Float8Recipe):
        raise ValueError(f"`recipe` must be a Float8Recipe or its config dict. Got {recipe!r}.")
    return recipe


def _amax(amax_history, algo: str):
    return ops.max(amax_history, axis=0) if algo == "max" else amax_history[0]


def compute_scale(
    amax_history, recipe: Float8Recipe | None = None, fp8_dtype: str = "float8_e4m3fn", scale=1.0
):
    """The recipe's FP8 scale for one tensor: `fp8_max / amax / 2**margin`.

    Args:
        amax_history: 1-D tensor of absolute maxima, newest first.
        recipe: A `Float8Recipe` (default `Float8Recipe()`).
        fp8_dtype: `"float8_e4m3fn"` (max 448) or `"float8_e5m2"` (max 57344).
        scale: Returned instead when the amax is zero or not finite (nothing seen yet,
            or an overflow): the previous scale.

    Returns:
        A float32 scalar tensor: the multiplier applied before the cast to FP8.

    Example:

    >>> float(compute_scale(np.array([2.0, 7.0, 0.0]), Float8Recipe(margin=1)))  # 448 / 7 / 2
    32.0
    """
    recipe = as_recipe(recipe)
    if fp8_dtype not in _FP8_DTYPES:
        raise ValueError(f"compute_scale: invalid `fp8_dtype`={fp8_dtype!r}. Valid: {_FP8_DTYPES}.")
    new, ok = _scale(amax_history, recipe, fp8_dtype)
    return ops.where(ok, new, ops.cast(scale, "float32"))


def _scale(amax_history, recipe: Float8Recipe, fp8_dtype: str):
    """(fp8_max / amax / 2**margin, whether amax is usable: > 0 and finite)."""
    fp8_max = float(ml_dtypes.finfo(fp8_dtype).max)
    amax = _amax(ops.cast(amax_history, "float32"), recipe.amax_compute_algo)
    ok = ops.logical_and(ops.greater(amax, 0.0), ops.isfinite(amax))
    safe_amax = ops.where(ok, amax, 1.0)
    return ops.divide(ops.divide(fp8_max, safe_amax), float(2**recipe.margin)), ok


@keras.saving.register_keras_serializable(package="keras_mp")
class Float8DTypePolicy(QuantizedFloat8DTypePolicy):
    """Keras' float8 dtype policy, carrying a `Float8Recipe`.

    Its `amax_history_length` is the recipe's; `Float8Dense`, `Float8EinsumDense` and the
    float8 attention layers read the rest of the recipe from it. Saved with the layer.

    Args:
        recipe: A `Float8Recipe` or its config dict (default `Float8Recipe()`).
        source_name: The policy the non-matmul math runs under, e.g. `"mixed_bfloat16"`
            (default: the global policy).
    """

    def __init__(self, recipe: Float8Recipe | dict | None = None, source_name: str | None = None):
        self.recipe = as_recipe(recipe)
        super().__init__("float8", source_name, self.recipe.amax_history_len)

    def __eq__(self, other):
        return super().__eq__(other) and self.recipe == other.recipe

    def get_config(self) -> dict:
        return {"recipe": self.recipe.get_config(), "source_name": self._source_name}
