"""Layer normalization for low-precision tensors on TensorFlow's executor.

Keras' `LayerNormalization` under a mixed policy up-casts its input, takes the mean and the
variance in float32 and casts the result back: about a dozen TF kernels forward and twice
as many in the automatic gradient, which keeps float32 copies of the input and of the
normalised values for the backward pass. This version runs the forward pass and the
backward pass as one XLA cluster each (`jit_compile=True` functions called from the
ordinary TF graph: XLA fuses the element-wise work into a few loops) and keeps, besides the
input, only the float32 mean and reciprocal standard deviation of each row. The math is
Keras' (float32 statistics, `rsqrt(variance + epsilon)`), normalising over the last axis.

Example:

```python
from keras_mp.tf.normalization import layer_norm_float32_math

y = layer_norm_float32_math(x_bf16, gamma, beta, epsilon=1e-3)   # bfloat16 out
```
"""

from __future__ import annotations

import functools

__all__ = ["layer_norm_float32_math"]


@functools.cache
def _kernels(epsilon: float):
    """The forward and backward kernels, each one XLA cluster (`jit_compile=True`)."""
    import tensorflow as tf

    f32 = tf.float32

    @tf.function(jit_compile=True, autograph=False)
    def forward(x, gamma, beta):
        xf = tf.cast(x, f32)
        mean = tf.reduce_mean(xf, -1, keepdims=True)
        centred = xf - mean
        rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(centred), -1, keepdims=True) + epsilon)
        y = centred * rstd
        if gamma is not None:
            y = y * gamma
        if beta is not None:
            y = y + beta
        return tf.cast(y, x.dtype), mean, rstd

    @tf.function(jit_compile=True, autograph=False)
    def backward(x, gamma, mean, rstd, upstream):
        xhat = (tf.cast(x, f32) - mean) * rstd
        dy = tf.cast(upstream, f32)
        rows = list(range(x.shape.rank - 1))
        dgamma = tf.reduce_sum(dy * xhat, rows)
        dbeta = tf.reduce_sum(dy, rows)
        dxhat = dy if gamma is None else dy * gamma
        dx = rstd * (
            dxhat
            - tf.reduce_mean(dxhat, -1, keepdims=True)
            - xhat * tf.reduce_mean(dxhat * xhat, -1, keepdims=True)
        )
        return tf.cast(dx, x.dtype), dgamma, dbeta

    return forward, backward


def layer_norm_float32_math(x, gamma=None, beta=None, epsilon: float = 1e-3):
    """Normalises `x` over its last axis with float32 statistics; returns `x.dtype`.

    Args:
        x: A floating tensor of known rank.
        gamma: Optional float32 scale of shape `x.shape[-1:]`.
        beta: Optional float32 offset of shape `x.shape[-1:]`.
        epsilon: Added to the variance.

    Returns:
        `(x - mean) * rsqrt(variance + epsilon) * gamma + beta` in `x.dtype`; gradients
        for `x` (in `x.dtype`), `gamma` and `beta` (float32) come from the custom backward
        kernel.

    Example:

    ```python
    y = layer_norm_float32_math(tf.ones((2, 8), tf.bfloat16), tf.ones(8), tf.zeros(8))
    ```
    """
    import tensorflow as tf

    forward, backward = _kernels(float(epsilon))
    present = [p is not None for p in (gamma, beta)]

    @tf.custom_gradient
    def norm(x, *params):
        it = iter(params)
        g, b = (next(it) if here else None for here in present)
        y, mean, rstd = forward(x, g, b)

        def grad(upstream):
            dx, dgamma, dbeta = backward(x, g, mean, rstd, upstream)
            return (dx, *(d for d, here in zip((dgamma, dbeta), present) if here))

        return y, grad

    params = [tf.convert_to_tensor(p) for p in (gamma, beta) if p is not None]
    return norm(tf.convert_to_tensor(x), *params)
