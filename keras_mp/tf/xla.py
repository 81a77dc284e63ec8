"""Whether the TensorFlow graph being built is for XLA (`jit_compile=True`).

keras_mp's TensorFlow kernels (`keras_mp.tf.losses`, `.activations`, `.normalization`) are written
for TF's executor and oneDNN; under XLA the `keras.ops` formulations fuse better, so the
public functions ask this before taking a TF kernel.

Example:

```python
from keras_mp.tf.xla import compiling_with_xla

compiling_with_xla()   # False in eager mode and in a plain tf.function
```
"""

from __future__ import annotations

import math

import keras

__all__ = ["compiling_with_xla", "worth_a_cluster"]

_LOW_PRECISION = ("float16", "bfloat16")


def compiling_with_xla() -> bool:
    """Whether the TensorFlow graph being built will be compiled by XLA (`jit_compile=True`).

    Uses TensorFlow's private `control_flow_util` (no public API says this); False if it
    moves.

    Returns:
        True inside a `tf.function(jit_compile=True)` (or a function it calls), else False.
    """
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - a future TensorFlow
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def worth_a_cluster(x, min_elements: int, dtype=None) -> bool:
    """Whether a keras_mp TF kernel (float32 math for low-precision tensors) should take
    `x`: computed in float16/bfloat16, not under XLA, every axis but the first known when
    the graph is built, and at least `min_elements` values (or an unknown first axis).

    Launching an XLA cluster costs tens of microseconds; below a few ten thousand values
    TensorFlow's own kernels are as fast (see the kernels' `MIN_ELEMENTS`). And XLA compiles
    a cluster again for every new input shape: an unknown batch axis takes few values
    (`fit` traces its step with one: the full batches and the last one), but an unknown
    inner axis (sequences padded per batch, buckets; Keras relaxes the traced shapes when
    they keep changing) can take hundreds, and the recompilations would cost more than the
    kernels save, so such tensors take TensorFlow's own kernels.

    Args:
        x: A tensor (or anything with a `shape` and a `dtype`).
        min_elements: The smallest size worth a cluster.
        dtype: The dtype the kernel would compute in; default: `x.dtype`.

    Returns:
        True when the kernel should be used.
    """
    if keras.backend.standardize_dtype(dtype or x.dtype) not in _LOW_PRECISION:
        return False
    dims = tuple(x.shape)
    if any(d is None for d in dims[1:]):
        return False
    big = (dims and dims[0] is None) or math.prod(dims) >= min_elements
    return bool(big) and not compiling_with_xla()
