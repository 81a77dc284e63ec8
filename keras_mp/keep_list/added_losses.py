"""Custom layers whose own `call` adds a loss or updates a variable: their own math runs
in float32.

keras.io's training-loop guide adds `1e-2 * ops.sum(inputs)` from a layer's `call`. In
float16 that sum passes 65,504 (a batch of 64 activations of 16 units averaging 64 is
enough) and the loss is `inf`. The layer's weights and sublayers do not decide that dtype,
its own math does: `kmp.convert` pins such a layer's own math to float32 (the keep-list's
rule, not an entry: a layer that adds a loss is no matter of taste), its sublayers keep the
compute dtype. Keras', keras_hub's and keras_mp's own layers are not read.

The same holds for a layer that keeps a running total in a float32 variable of its own
(`self.total.assign_add(ops.sum(x))`): inside a float16 layer's call Keras reads float32
variables as float16 (its autocast), so the sum is taken and added in float16, drifts, and
becomes `inf` past 65,504. Its own math in float32 adds in float32.

Nothing here imports the rest of keras_mp.
"""

from __future__ import annotations

import functools
import inspect

import keras

__all__ = ["REASON", "UPDATE_REASON", "adds_loss_in_call", "updates_state_in_call"]

REASON = "its call adds a loss (add_loss): computed in float32, float16 would overflow"
UPDATE_REASON = (
    "its call updates a variable of its own (assign/assign_add): in float16 Keras would "
    "add in float16 (a running sum drifts and passes 65504)"
)
_UPDATES = ("assign_add(", "assign_sub(", ".assign(")
_LIBRARIES = ("keras.", "keras_hub.", "keras_mp.", "tensorflow.", "tf_keras.")


@functools.lru_cache(maxsize=1024)
def _source(call) -> str:
    try:
        return inspect.getsource(call)
    except (OSError, TypeError):  # no source (a REPL, a compiled module): cannot tell
        return ""


def _users_call(layer):
    """The user's own `call` of `layer`'s class, or None (a library's, or none)."""
    cls = type(layer)
    owner = next((c for c in cls.__mro__ if "call" in c.__dict__), None)
    if owner is None or owner.__module__.startswith(_LIBRARIES):
        return None
    return owner.__dict__["call"]


def adds_loss_in_call(layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s class, a user's, calls `add_loss` in its own `call`.

    Args:
        layer: A Keras layer.

    Returns:
        A bool (False for Keras', keras_hub's and keras_mp's own layers).
    """
    call = _users_call(layer)
    return call is not None and "add_loss(" in _source(call)


def updates_state_in_call(layer: keras.layers.Layer) -> bool:
    """Whether `layer`'s class, a user's, updates (`assign`, `assign_add`, `assign_sub`) in
    its own `call` a float variable the layer owns (a running total, a counter).

    Args:
        layer: A Keras layer.

    Returns:
        A bool (False for Keras', keras_hub's and keras_mp's own layers).
    """
    call = _users_call(layer)
    if call is None:
        return False
    own = list(layer._trainable_variables) + list(layer._non_trainable_variables)
    if not any(keras.backend.is_float_dtype(v.dtype) for v in own):
        return False
    source = _source(call)
    return any(u in source for u in _UPDATES)
