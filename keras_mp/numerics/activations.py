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

from keras_mp.numerics.gelu_math import gelu_float32, gelu_slope_float32

__all__ = ["gelu"]

_FLOAT32 = "float32"
_LOW_PRECISION = ("float16", "bfloat16")


def _as_saved(x):
    """`x` as kept for a backward pass: on JAX behind an optimization barrier, so that XLA
    keeps `x` itself rather than a float32 copy it shares with the forward pass."""
    if keras.backend.backend() != "jax":
        return x
    from keras_mp.jax.xla import as_saved

    return as_saved(x)


def _gelu_keeping_input(x, approximate: bool):
    """`gelu_float32` rounded to `x.dtype`, whose gradient is recomputed from `x` alone."""

    @ops.custom_gradient
    def fn(x):
        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            slope = gelu_slope_float32(ops.cast(_as_saved(x), _FLOAT32), approximate)
            return ops.cast(ops.cast(upstream, _FLOAT32) * slope, x.dtype)

        return ops.cast(gelu_float32(ops.cast(x, _FLOAT32), approximate), x.dtype), grad

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
