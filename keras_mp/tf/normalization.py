"""Layer normalization for low-precision tensors on TensorFlow's executor.

Keras' `LayerNormalization` under a mixed policy up-casts its input, takes the mean and the
variance in float32 and casts the result back: about a dozen TF kernels forward and twice
as many in the automatic gradient, which keeps float32 copies of the input and of the
normalised values for the backward pass. This version runs the forward pass and the
backward pass as one XLA cluster each (`jit_compile=True` functions called from the
ordinary TF graph: XLA fuses the element-wise work into a few loops) and keeps, besides the
input, only the float32 mean and reciprocal standard deviation of each row. XLA:CPU
materialises the float32 inputs of its reductions, so rows go through the clusters in blocks
of about `BLOCK_ELEMENTS` values; it needs less than half the temporaries of Keras' layer
and is faster on large inputs (benchmarks/BENCHMARKS.md). The math is Keras' (float32
statistics, `rsqrt(variance + epsilon)`), normalising over the last axis.

Example:

```python
from keras_mp.tf.normalization import layer_norm_float32_math

y = layer_norm_float32_math(x_bf16, gamma, beta, epsilon=1e-3)   # bfloat16 out
```
"""

from __future__ import annotations

import functools

__all__ = ["BLOCK_ELEMENTS", "MIN_ELEMENTS", "layer_norm_float32_math"]

MIN_ELEMENTS = 2**17
"""Smallest input `keras_mp.layers.LayerNormalization` sends here: below it, launching the
XLA clusters costs more than Keras' own kernels."""

BLOCK_ELEMENTS = 2**19  # values per block of rows (XLA:CPU keeps ~4 float32 copies of one)


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
        # 2-D blocks of rows; gamma's and beta's gradients as this block's [1, d] sums.
        xhat = (tf.cast(x, f32) - mean) * rstd
        dy = tf.cast(upstream, f32)
        dgamma = tf.reduce_sum(dy * xhat, 0, keepdims=True)
        dbeta = tf.reduce_sum(dy, 0, keepdims=True)
        dxhat = dy if gamma is None else dy * gamma
        dx = rstd * (
            dxhat
            - tf.reduce_mean(dxhat, -1, keepdims=True)
            - xhat * tf.reduce_mean(dxhat * xhat, -1, keepdims=True)
        )
        return tf.cast(dx, x.dtype), dgamma, dbeta

    return forward, backward


def _by_rows(kernel, dtypes, rows: int, *blocked):
    """`kernel` over blocks of `rows` rows of the 2-D `blocked` tensors (the last block may
    be shorter), one block at a time; its outputs concatenated along axis 0. A single call
    when everything fits one block."""
    import tensorflow as tf

    n = blocked[0].shape[0]
    if n is not None and n <= rows:
        return kernel(*blocked)
    n = tf.shape(blocked[0])[0]
    blocks = (n + rows - 1) // rows

    def body(i, outs):
        size = tf.minimum(rows, n - i * rows)
        parts = (tf.slice(t, [i * rows, 0], [size, -1]) for t in blocked)
        return i + 1, tuple(o.write(i, r) for o, r in zip(outs, kernel(*parts), strict=True))

    outs = tuple(tf.TensorArray(d, size=blocks, infer_shape=False) for d in dtypes)
    # One block at a time: XLA:CPU materialises the inputs of its reductions (float32
    # copies of the block), so two blocks in flight would double those temporaries.
    _, outs = tf.while_loop(lambda i, _: i < blocks, body, (tf.constant(0), outs))
    return tuple(o.concat() for o in outs)


def layer_norm_float32_math(
    x, gamma=None, beta=None, epsilon: float = 1e-3, block_elements: int = BLOCK_ELEMENTS
):
    """Normalises `x` over its last axis with float32 statistics; returns `x.dtype`.

    Args:
        x: A floating tensor whose last axis has a known size.
        gamma: Optional scale of shape `x.shape[-1:]` (used in float32).
        beta: Optional offset of shape `x.shape[-1:]` (used in float32).
        epsilon: Added to the variance.
        block_elements: Rows are processed in blocks of about this many values, so that the
            float32 temporaries of XLA:CPU's reductions stay bounded (about 4 float32 copies
            of a block: 8 MiB at the default) whatever the size of `x`.

    Returns:
        `(x - mean) * rsqrt(variance + epsilon) * gamma + beta` in `x.dtype`; gradients
        for `x` (in `x.dtype`), `gamma` and `beta` (in their dtypes) come from the custom
        backward kernel.

    Example:

    ```python
    y = layer_norm_float32_math(tf.ones((2, 8), tf.bfloat16), tf.ones(8), tf.zeros(8))
    ```
    """
    import tensorflow as tf

    forward, backward = _kernels(float(epsilon))
    x = tf.convert_to_tensor(x)
    width = x.shape[-1]
    if width is None:
        raise ValueError(f"The last axis of the input must have a known size; got {x.shape}.")
    rows = max(1, block_elements // width)
    present = [p is not None for p in (gamma, beta)]
    f32 = tf.float32

    @tf.custom_gradient
    def norm(x2d, *params):
        it = iter(params)
        g, b = (next(it) if here else None for here in present)
        y, mean, rstd = _by_rows(lambda xb: forward(xb, g, b), (x2d.dtype, f32, f32), rows, x2d)

        def grad(upstream):
            dx, dgamma, dbeta = _by_rows(
                lambda xb, mb, rb, ub: backward(xb, g, mb, rb, ub),
                (x2d.dtype, f32, f32),
                rows,
                x2d,
                mean,
                rstd,
                upstream,
            )
            sums = (tf.reduce_sum(dgamma, 0), tf.reduce_sum(dbeta, 0))
            return (dx, *(d for d, here in zip(sums, present, strict=True) if here))

        return y, grad

    # float32 whatever the variables' dtype (a pure float16/bfloat16 layer keeps them low).
    params = [tf.cast(p, f32) for p in (gamma, beta) if p is not None]
    y = norm(tf.reshape(x, [-1, width]), *params)
    return tf.reshape(y, tf.shape(x))
