"""Whether the TensorFlow graph being built is for XLA (`jit_compile=True`).

keras_mp's TensorFlow kernels (`keras_mp.tf.losses`, `keras_mp.tf.activations`) are written
for TF's executor and oneDNN; under XLA the `keras.ops` formulations fuse better, so the
public functions ask this before taking a TF kernel.

Example:

```python
from keras_mp.tf.xla import compiling_with_xla

compiling_with_xla()   # False in eager mode and in a plain tf.function
```
"""

from __future__ import annotations

__all__ = ["compiling_with_xla"]


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
