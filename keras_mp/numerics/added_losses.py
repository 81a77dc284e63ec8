"""Losses a model adds (`add_loss`, activity regularizers) come out in float32.

Keras keeps an added loss in the dtype it was computed in. Under `"mixed_float16"` (Keras'
or a converted model) a layer's `self.add_loss(...)` and its activity regularizer compute
from float16 activations: `model.losses` holds float16 scalars, so the training-loop
guide's `loss += sum(model.losses)` adds float16 to the float32 loss (a `TypeError` on
TensorFlow), and `1e-2 * sum(activations)` passes 65,504 and becomes `inf`. Keras' own
`fit` casts them when it sums them; a user's loop does not.

`install()` (done by `import keras_mp`) wraps:

- `keras.layers.Layer.add_loss`: a float16 or bfloat16 loss is cast to float32 as it is
  added (what `model.losses` then holds);
- the `__call__` of Keras' built-in regularizers (`L1`, `L2`, `L1L2`,
  `OrthogonalRegularizer`): they compute from float32, so an activity regularizer on a
  float16 layer does not overflow.

A custom layer whose own `call` adds a loss computed from its inputs is pinned to float32
by `kmp.convert` (`keras_mp.keep_list`: its own math only), so that sum never runs in
float16. Nothing changes for float32 models.
"""

from __future__ import annotations

import functools

import keras

__all__ = ["install", "installed", "uninstall"]

_FLAG = "_keras_mp_float32_losses"
_LOW = ("float16", "bfloat16")


def _float32(x):
    dtype = getattr(x, "dtype", None)
    if dtype is not None and keras.backend.standardize_dtype(dtype) in _LOW:
        return keras.ops.cast(x, "float32")
    return x


def _regularizers() -> list:
    return [
        keras.regularizers.L1,
        keras.regularizers.L2,
        keras.regularizers.L1L2,
        keras.regularizers.OrthogonalRegularizer,
    ]


def install() -> None:
    """Wraps `Layer.add_loss` and the built-in regularizers' `__call__`; idempotent."""
    original = keras.layers.Layer.add_loss
    if not getattr(original, _FLAG, False):

        @functools.wraps(original)
        def add_loss(self, loss):
            return original(self, keras.tree.map_structure(_float32, loss))

        setattr(add_loss, _FLAG, True)
        keras.layers.Layer.add_loss = add_loss
    for cls in _regularizers():
        call = cls.__dict__.get("__call__")
        if call is None or getattr(call, _FLAG, False):
            continue

        def wrapped(self, x, _call=call):
            return _call(self, _float32(x))

        functools.update_wrapper(wrapped, call)
        setattr(wrapped, _FLAG, True)
        cls.__call__ = wrapped


def uninstall() -> None:
    """Gives Keras its own `add_loss` and regularizers back; idempotent."""
    current = keras.layers.Layer.add_loss
    if getattr(current, _FLAG, False):
        keras.layers.Layer.add_loss = current.__wrapped__
    for cls in _regularizers():
        call = cls.__dict__.get("__call__")
        if getattr(call, _FLAG, False):
            cls.__call__ = call.__wrapped__


def installed() -> bool:
    """Whether added losses and built-in regularizers come out in float32."""
    return bool(getattr(keras.layers.Layer.add_loss, _FLAG, False))
