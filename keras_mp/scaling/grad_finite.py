"""The one finiteness test of a step's gradients, shared by every step that skips.

`kmp.LossScaleOptimizer` (float16's dynamic scale, and the fixed scale of 1 that compile
gives a `"mixed_bfloat16"` or `"float32"` model under a keras_mp policy) decides with it
whether a step reaches the weights. Written in `keras.ops`: it runs inside the compiled
train step, with no host synchronisation.
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

__all__ = ["is_sparse", "per_variable_finite", "sparse_values", "with_static_shape"]


def is_sparse(g) -> bool:
    """Whether `g` is an `IndexedSlices`-like gradient (indices, values, dense shape)."""
    return hasattr(g, "indices") and hasattr(g, "values") and hasattr(g, "dense_shape")


def sparse_values(g):
    """The values of a sparse gradient, or the gradient itself."""
    return g.values if is_sparse(g) else g


def with_static_shape(g, variable):
    """A dense gradient whose static shape is not fully known (TensorFlow, e.g. through a
    sequence of unknown length) reshaped to its variable's: the inner optimizer's update
    needs it (`as_list() is not defined on an unknown TensorShape`)."""
    if g is None or is_sparse(g):
        return g
    shape = g.shape
    if getattr(shape, "rank", 0) is None:  # a TensorShape of unknown rank
        return ops.reshape(g, variable.shape)
    return g if all(d is not None for d in shape) else ops.reshape(g, variable.shape)


def per_variable_finite(grads) -> Any:
    """One bool per gradient: all of its values finite (True for None).

    Args:
        grads: a list of gradients (dense, sparse or None).

    Returns:
        A bool tensor of shape `(len(grads),)`.

    Example:

    >>> bool(per_variable_finite([ops.ones((2,)), None])[1])
    True
    """
    if not grads:
        return ops.ones((0,), "bool")
    if keras.backend.backend() != "jax":
        flags = [ops.all(ops.isfinite(sparse_values(g))) if g is not None else None for g in grads]
        return ops.stack([ops.ones((), "bool") if f is None else f for f in flags])
    # XLA: gradients of one shape are checked by one reduction over their stack (XLA fuses
    # the stack into it, nothing is copied), not one kernel each (BENCHMARKS.md section 9).
    flags = [ops.ones((), "bool")] * len(grads)
    groups: dict = {}
    for i, g in enumerate(grads):
        if g is not None:
            groups.setdefault((tuple(g.shape), str(g.dtype)), []).append(i)
    for (shape, _), indices in groups.items():
        stacked = ops.stack([grads[i] for i in indices])
        rows = ops.reshape(ops.isfinite(stacked), (len(indices), math.prod(shape)))
        finite = ops.all(rows, axis=1)
        for j, i in enumerate(indices):
            flags[i] = finite[j]
    return ops.stack(flags)
