"""Keras' `Orthogonal` initializer makes float16 and bfloat16 weights from float32.

Keras draws an orthogonal matrix with a QR decomposition in the variable's dtype; neither
backend has one in low precision: on JAX jaxlib raises `NotImplementedError: Unsupported
dtype float16` (and bfloat16) from LAPACK, on TensorFlow bfloat16 is refused. So a
recurrent layer (`LSTM`, `GRU`, `SimpleRNN`: their recurrent kernels) cannot be built
under Keras' pure `"float16"` on JAX, or with bfloat16 variables anywhere (pure
`"bfloat16"`, `"lean_bfloat16"` builds).

`install()` (done by `import keras_mp`) wraps `keras.initializers.Orthogonal.__call__`: for
a float16 or bfloat16 dtype it draws the matrix in float32, as for a float32 weight, and
casts it, so the layer builds with the weights a float32 build would round to. Other dtypes
are Keras' own.
"""

from __future__ import annotations

import functools

import keras

__all__ = ["install", "installed", "uninstall"]

_FLAG = "_keras_mp_float32_draw"
_LOW = ("float16", "bfloat16")


def install() -> None:
    """Wraps `keras.initializers.Orthogonal.__call__`; idempotent."""
    cls = keras.initializers.Orthogonal
    original = cls.__dict__["__call__"]
    if getattr(original, _FLAG, False):
        return

    @functools.wraps(original)
    def __call__(self, shape, dtype=None):
        wanted = keras.backend.standardize_dtype(dtype or keras.config.floatx())
        if wanted not in _LOW:
            return original(self, shape, dtype=dtype)
        return keras.ops.cast(original(self, shape, dtype="float32"), wanted)

    setattr(__call__, _FLAG, True)
    cls.__call__ = __call__


def uninstall() -> None:
    """Gives `Orthogonal` Keras' own `__call__` back; idempotent."""
    cls = keras.initializers.Orthogonal
    call = cls.__dict__["__call__"]
    if getattr(call, _FLAG, False):
        cls.__call__ = call.__wrapped__


def installed() -> bool:
    """Whether `Orthogonal` draws low-precision weights in float32."""
    return bool(getattr(keras.initializers.Orthogonal.__dict__["__call__"], _FLAG, False))
