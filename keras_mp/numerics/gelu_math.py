"""The float32 GELU math shared by `keras_mp.activations` and `keras_mp.tf.activations`.

Written with `keras.ops` only, so the backend-neutral module and the TensorFlow one both
import it and neither imports the other back. `erfc` is `keras.ops.erfc` where Keras has
it (3.13 and later); on older Keras (3.12, the oldest TensorFlow 2.21 allows) it is a
rational approximation (Numerical Recipes' `erfcc`, relative error below 1.2e-7
everywhere; a few float32 ulps once rounded) that, like `erfc`, keeps its relative
precision in the far tail where `1 - erf(x)` would round to 0.

Example:

```python
from keras_mp.numerics.gelu_math import gelu_float32

y = gelu_float32(keras.ops.convert_to_tensor([-1.0, 0.0, 2.0]), approximate=False)
```
"""

from __future__ import annotations

from keras import ops

__all__ = ["erfc", "gelu_float32", "gelu_slope_float32"]

_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_SQRT_2_OVER_PI = 0.7978845608028654
_TANH_CUBIC = 0.044715
# Numerical Recipes (2nd ed., 6.2) erfcc: erfc(z) = t * exp(-z^2 + P(t)), t = 1/(1 + z/2).
_ERFCC = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)


def _erfc_rational(z):
    """erfc of a float32 tensor, relative error < 1.2e-7 (for Keras without `ops.erfc`)."""
    a = ops.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = _ERFCC[-1]
    for c in reversed(_ERFCC[:-1]):
        poly = c + t * poly
    # a^2 in float32 is off by up to 4e-6 absolute near a = 9: split a = hi + lo with `hi`
    # on a 1/16 grid, so hi^2 is exact and only the small lo * (a + hi) is rounded.
    hi = ops.floor(a * 16.0) / 16.0
    tail = t * ops.exp(-ops.square(hi)) * ops.exp(-(a - hi) * (a + hi) + poly)
    return ops.where(z >= 0, tail, 2.0 - tail)


def erfc(z):
    """The complementary error function `1 - erf(z)`, accurate in the tail."""
    if hasattr(ops, "erfc"):
        return ops.erfc(z)
    return _erfc_rational(z)


def _tanh_argument(xf):
    return _SQRT_2_OVER_PI * (xf + _TANH_CUBIC * xf * ops.square(xf))


def gelu_float32(xf, approximate: bool):
    """GELU of a float32 tensor in `keras.ops`: `x * Phi(x)`, Phi the (tanh-approximated)
    normal CDF, written without cancellation for large negative `x`."""
    if approximate:  # 0.5 * (1 + tanh(u)) = sigmoid(2u)
        return xf * ops.sigmoid(2.0 * _tanh_argument(xf))
    return 0.5 * xf * erfc(-_SQRT_HALF * xf)


def gelu_slope_float32(xf, approximate: bool):
    """The derivative of `gelu_float32`: `Phi(x) + x * Phi'(x)`."""
    if approximate:
        cdf = ops.sigmoid(2.0 * _tanh_argument(xf))
        inner_slope = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * ops.square(xf))
        return cdf + xf * (2.0 * cdf * (1.0 - cdf)) * inner_slope
    cdf = 0.5 * erfc(-_SQRT_HALF * xf)
    return cdf + xf * (_INV_SQRT_2PI * ops.exp(-0.5 * ops.square(xf)))
