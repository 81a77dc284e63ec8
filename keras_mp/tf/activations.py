"""GELU for low-precision tensors on TensorFlow's executor: float32 math, one saved input.

TensorFlow runs `tf.nn.gelu` on a bfloat16 tensor as bfloat16 element-wise kernels (Eigen
converts every element in and out of float32 in each of them), and its automatic gradient
adds about ten more such kernels plus the intermediates it keeps for them: in a bfloat16
transformer step the FFN's GELU is then the most expensive element-wise work. This version
casts once to float32,
computes the GELU there, casts the result back, and keeps only its input for the backward
pass, where the derivative `Phi(x) + x * phi(x)` is recomputed in float32 as well. Forward
and backward are one XLA cluster each (`jit_compile=True` functions called from the
ordinary TF graph; the surrounding matmuls stay on oneDNN). The result is the float32 GELU
rounded once to the input's dtype (Keras' is rounded after each step); it is several times
faster than TF's and needs a quarter of its temporaries (benchmarks/BENCHMARKS.md).

Under XLA (`jit_compile=True`) the element-wise work fuses anyway: `keras_mp.activations.gelu`
takes Keras' own GELU there.

Example:

```python
from keras_mp.tf.activations import gelu_float32_math

y = gelu_float32_math(x_bf16)            # bfloat16, computed in float32
y = gelu_float32_math(x_bf16, True)      # the tanh approximation
```
"""

from __future__ import annotations

import functools

from keras_mp.numerics.gelu_math import gelu_float32, gelu_slope_float32

__all__ = ["MIN_ELEMENTS", "gelu_float32_math"]

MIN_ELEMENTS = 2**14
"""Smallest tensor `keras_mp.activations.gelu` sends here: below it, launching the XLA
clusters costs more than TF's own kernels."""


@functools.cache
def _kernels(approximate: bool):
    """The forward and backward GELU kernels, each one XLA cluster (`jit_compile=True`)."""
    import tensorflow as tf

    @tf.function(jit_compile=True, autograph=False)
    def forward(x):
        return tf.cast(gelu_float32(tf.cast(x, tf.float32), approximate), x.dtype)

    @tf.function(jit_compile=True, autograph=False)
    def backward(x, upstream):
        slope = gelu_slope_float32(tf.cast(x, tf.float32), approximate)
        return tf.cast(tf.cast(upstream, tf.float32) * slope, x.dtype)

    return forward, backward


def gelu_float32_math(x, approximate: bool = False):
    """GELU of `x` computed in float32, returned in `x.dtype`, with a recomputing gradient.

    Args:
        x: A floating tensor.
        approximate: Whether to use the tanh approximation (as `keras.activations.gelu`).

    Returns:
        `gelu(x)` in `x.dtype`; its gradient is computed in float32 from `x` alone.

    Example:

    ```python
    y = gelu_float32_math(tf.constant([-1.0, 0.0, 2.0], tf.bfloat16))
    ```
    """
    import tensorflow as tf

    forward, backward = _kernels(bool(approximate))

    @tf.custom_gradient
    def gelu(x):
        return forward(x), lambda upstream: backward(x, upstream)

    return gelu(tf.convert_to_tensor(x))
