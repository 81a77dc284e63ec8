"""Activations with a float32-math kernel for low-precision tensors.

`gelu` is `keras.activations.gelu` (same arguments, same result up to rounding) whose
TensorFlow version, on float16/bfloat16 tensors outside XLA (of at least
`keras_mp.tf.activations.MIN_ELEMENTS` values, every axis but the first known when the graph
is built: see `keras_mp.tf.xla.worth_a_cluster`), computes in float32 and keeps
only its input for the backward pass (`keras_mp.tf.activations`): on the `cpu_gpt`
benchmark TF's own GELU in bfloat16 was the costliest element-wise work of the step.
`keras_mp.convert` gives it to the layers of a low-precision model whose activation is
Keras' GELU; on other backends, under XLA and on float32 it is Keras' GELU.

Example:

```python
import keras, keras_mp as kmp

layer = keras.layers.Dense(4096, activation=kmp.activations.gelu)
```
"""

from __future__ import annotations

import keras

__all__ = ["gelu"]

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
    x = keras.ops.convert_to_tensor(x)
    if keras.backend.backend() == "tensorflow":
        from keras_mp.tf.activations import MIN_ELEMENTS, gelu_float32_math
        from keras_mp.tf.xla import worth_a_cluster

        if worth_a_cluster(x, MIN_ELEMENTS):
            return gelu_float32_math(x, approximate)
    return keras.activations.gelu(x, approximate=approximate)
