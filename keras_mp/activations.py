"""Activations computed in float32 for low-precision tensors, keeping only their input.

`gelu` is `keras.activations.gelu` (same arguments, same result up to rounding) that, on a
float16/bfloat16 tensor, computes in float32, rounds once to the tensor's dtype, and keeps
only its input for the backward pass, where the derivative `Phi(x) + x * phi(x)` is
recomputed in float32. Differentiating Keras' GELU keeps its intermediates instead: under
XLA (JAX, TensorFlow with `jit_compile=True`) the elementwise work fuses, but the fusion
writes two or three more tensors of the input's size for the backward pass, a visible share
of a transformer step's peak memory (benchmarks/BENCHMARKS.md).

On TensorFlow outside XLA the same math runs as two XLA clusters (`keras_mp.tf.activations`:
TF's executor would run each element-wise op as its own bfloat16 kernel), for tensors of at
least `keras_mp.tf.activations.MIN_ELEMENTS` values whose axes after the first are known when
the graph is built (see `keras_mp.tf.xla.worth_a_cluster`); smaller ones take Keras' GELU.
Under TensorFlow's XLA (`jit_compile=True`) it is the same custom gradient as on JAX but
without the optimization barrier (TensorFlow has no public one), so XLA may keep a float32
copy of the input there: the bytes of Keras' GELU, with float32 math. Float32 tensors, and
the PyTorch backend, take Keras' GELU.
`keras_mp.convert` gives it to the layers of a low-precision model whose activation is
Keras' GELU.

Example:

```python
import keras, keras_mp as kmp

layer = keras.layers.Dense(4096, activation=kmp.activations.gelu)
```
"""

from __future__ import annotations

import keras
from keras import ops

__all__ = ["gelu"]

_FLOAT32 = "float32"
_LOW_PRECISION = ("float16", "bfloat16")
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_SQRT_2_OVER_PI = 0.7978845608028654
_TANH_CUBIC = 0.044715


def _tanh_argument(xf):
    return _SQRT_2_OVER_PI * (xf + _TANH_CUBIC * xf * ops.square(xf))


def _gelu_float32(xf, approximate: bool):
    """GELU of a float32 tensor in `keras.ops`: `x * Phi(x)`, Phi the (tanh-approximated)
    normal CDF, written without cancellation for large negative `x`."""
    if approximate:  # 0.5 * (1 + tanh(u)) = sigmoid(2u)
        return xf * ops.sigmoid(2.0 * _tanh_argument(xf))
    return 0.5 * xf * ops.erfc(-_SQRT_HALF * xf)


def _gelu_slope_float32(xf, approximate: bool):
    """The derivative of `_gelu_float32`: `Phi(x) + x * Phi'(x)`."""
    if approximate:
        cdf = ops.sigmoid(2.0 * _tanh_argument(xf))
        inner_slope = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * ops.square(xf))
        return cdf + xf * (2.0 * cdf * (1.0 - cdf)) * inner_slope
    cdf = 0.5 * ops.erfc(-_SQRT_HALF * xf)
    return cdf + xf * (_INV_SQRT_2PI * ops.exp(-0.5 * ops.square(xf)))


def _as_saved(x):
    """`x` as kept for a backward pass: on JAX behind an optimization barrier, so that XLA
    keeps `x` itself rather than a float32 copy it shares with the forward pass."""
    if keras.backend.backend() != "jax":
        return x
    from keras_mp.jax.xla import as_saved

    return as_saved(x)


def _gelu_keeping_input(x, approximate: bool):
    """`_gelu_float32` rounded to `x.dtype`, whose gradient is recomputed from `x` alone."""

    @ops.custom_gradient
    def fn(x):
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            slope = _gelu_slope_float32(ops.cast(_as_saved(x), _FLOAT32), approximate)
            return ops.cast(ops.cast(upstream, _FLOAT32) * slope, x.dtype)

        return ops.cast(_gelu_float32(ops.cast(x, _FLOAT32), approximate), x.dtype), grad

    return fn(x)


@keras.saving.register_keras_serializable(package="keras_mp", name="gelu")
def gelu(x, approximate: bool = False):
    """Gaussian error linear unit, `x * Phi(x)`, computed in float32 for low-precision `x`.

    Args:
        x: Input tensor.
        approximate: Whether to use the tanh approximation of `Phi`.

    Returns:
        `gelu(x)` in `x`'s dtype.

    Example:

    ```python
    y = kmp.activations.gelu(keras.ops.ones((2, 3), "bfloat16"))
    ```
    """
    x = ops.convert_to_tensor(x)
    if keras.backend.standardize_dtype(x.dtype) not in _LOW_PRECISION:
        return keras.activations.gelu(x, approximate=approximate)
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from keras_mp.tf.activations import MIN_ELEMENTS, gelu_float32_math
        from keras_mp.tf.xla import compiling_with_xla, worth_a_cluster

        if worth_a_cluster(x, MIN_ELEMENTS):
            return gelu_float32_math(x, approximate)
        if not compiling_with_xla():
            return keras.activations.gelu(x, approximate=approximate)
    elif backend != "jax":
        return keras.activations.gelu(x, approximate=approximate)
    return _gelu_keeping_input(x, bool(approximate))
