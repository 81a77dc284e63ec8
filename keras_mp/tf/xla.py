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

__all__ = ["compiling_with_xla", "worth_a_cluster"]


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


def worth_a_cluster(x, min_elements: int) -> bool:
    """Whether a keras_mp TF kernel should take `x`: not under XLA, and `x` has at least
    `min_elements` values (or a size unknown when the graph is built).

    Launching an XLA cluster costs tens of microseconds; below a few ten thousand values
    TensorFlow's own kernels are as fast (see the kernels' `MIN_ELEMENTS`).

    Args:
        x: A tensor (or anything with a `shape`).
        min_elements: The smallest size worth a cluster.

    Returns:
        True when the kernel should be used.
    """
    dims = tuple(x.shape)
    known = all(d is not None for d in dims)
    return (not known or math.prod(dims) >= min_elements) and not compiling_with_xla()
