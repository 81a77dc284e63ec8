"""Keeping a tensor as it is for the backward pass under XLA (JAX backend).

A custom gradient that recomputes from its input (`keras_mp.activations.gelu`) means to keep
only that input. But XLA merges identical expressions (common-subexpression elimination)
across the forward and backward passes: the backward's `cast(x, float32)` is the forward's,
so XLA keeps the float32 copy for the backward pass (twice the bytes of a bfloat16 `x`)
instead of `x`. An optimization barrier on the backward's view of `x` keeps the two apart.

Example:

```python
from keras_mp.jax.xla import as_saved

x = as_saved(x)     # in a custom gradient's backward function
```
"""

from __future__ import annotations

__all__ = ["as_saved"]


def as_saved(x):
    """`x`, hidden from XLA's merging with the forward pass (`jax.lax.optimization_barrier`).

    Args:
        x: A JAX array (a residual of a custom gradient).

    Returns:
        The same values; XLA computes nothing from it before it is needed.
    """
    import jax

    return jax.lax.optimization_barrier(x)
