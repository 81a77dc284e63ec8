"""The float32 pins a user wrote: a layer made float32 under a low global policy, or a
`DTypePolicyMap` entry.

Keras keeps no record of whether a layer's dtype was given or came from the global policy
(`Layer.__init__` resolves `dtype=None` to the global policy object and keeps only the
result). So `install()` (done by `import keras_mp`) wraps `keras.layers.Layer.__init__` to
note, on the layer, a float32 dtype its maker chose:

- a float32 dtype given while the global policy computes in another dtype (the Keras
  mixed-precision guide's `Activation("softmax", dtype="float32")` head, made under
  `"mixed_float16"`): a pin, which `kmp.convert` keeps (`user_pin`);
- `dtype="float32"` written as a string under a float32 global policy, for a layer that is
  not a model: ambiguous (a pin, or a helper's `dtype` argument that defaults to
  "float32"), so not kept but named by `convert`'s warning where only some layers have it
  (`chose_float32`).

Layers made while Keras deserializes (loading; an old file may save a dtype as a string)
get the dtype they were saved with, as the global policy then is
(`keras_mp.saving.sublayer_dtypes`): nothing is noted for them. Layers made before
`import keras_mp` are not noted either: for those, a float32 layer in a low-precision
model is still pinned (`keep_list.plan`'s "float32 in the source model").

A `keras.dtype_policies.DTypePolicyMap` of the user's (not one keras_mp made, whose default
is a keras_mp `Policy`) pins the paths it maps to float32.

Nothing here imports the rest of keras_mp but its door to Keras' internals.
"""

from __future__ import annotations

import functools

import keras

from keras_mp.keras_glue.keras_internals import in_safe_mode

__all__ = ["chose_float32", "install", "installed", "uninstall", "user_pin"]

_ATTR = "_keras_mp_user_dtype"
_CHOSE = "_keras_mp_chose_float32"
_FLAG = "_keras_mp_user_pins"


def _note(layer, dtype) -> None:
    policy = vars(layer).get("_dtype_policy")
    if policy is None or isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return  # a map's entries are read from the map itself
    if policy.compute_dtype != "float32" or policy.quantization_mode is not None:
        return
    current = keras.config.dtype_policy()
    if current.compute_dtype != "float32":
        reason = f"dtype {policy.name!r} set by the user (global policy {current.name!r})"
        object.__setattr__(layer, _ATTR, reason)
    elif isinstance(dtype, str) and not isinstance(layer, keras.Model):
        if in_safe_mode() is None:  # not inside Keras' deserialization (a saved dtype)
            object.__setattr__(layer, _CHOSE, True)


def user_pin(layer: keras.layers.Layer) -> str | None:
    """Why `layer` runs in float32 by its maker's choice, or None.

    Args:
        layer: A Keras layer.

    Returns:
        The reason (a float32 dtype set under a low global policy, or the user's
        `DTypePolicyMap` entry), or None.
    """
    if layer.compute_dtype != "float32":
        return None
    policy = vars(layer).get("_dtype_policy")
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap) and layer.path:
        default = policy.default_policy
        if type(default).__module__.startswith("keras_mp."):
            return None  # keras_mp's own map (a converted model): its pins are its plan's
        entry = policy[layer.path]
        if entry is not default and entry.quantization_mode is None:
            return f"float32 in the user's DTypePolicyMap (path {layer.path!r})"
        return None
    return vars(layer).get(_ATTR)


def chose_float32(layer: keras.layers.Layer) -> bool:
    """Whether `layer` was made with `dtype="float32"` written out under a float32 global
    policy (ambiguous: not a pin by itself; see the module docstring)."""
    return bool(vars(layer).get(_CHOSE)) and layer.compute_dtype == "float32"


def install() -> None:
    """Wraps `keras.layers.Layer.__init__` to note float32 dtypes a user chose; idempotent."""
    original = keras.layers.Layer.__init__
    if getattr(original, _FLAG, False):
        return

    # Keyword arguments only, as `Layer.__init__` takes them: Keras' `Operation.__new__`
    # reads `cls.__init__`'s argspec (this wrapper's, for a subclass without its own
    # `__init__`) beside its signature (the wrapped one's), and a `*args` here would
    # make the two disagree.
    @functools.wraps(original)
    def __init__(self, **kwargs):
        original(self, **kwargs)
        dtype = kwargs.get("dtype")
        if dtype is not None and not isinstance(self, keras.layers.InputLayer):
            _note(self, dtype)

    setattr(__init__, _FLAG, True)
    keras.layers.Layer.__init__ = __init__


def uninstall() -> None:
    """Gives `keras.layers.Layer` its own `__init__` back; idempotent."""
    current = keras.layers.Layer.__init__
    if getattr(current, _FLAG, False):
        keras.layers.Layer.__init__ = current.__wrapped__


def installed() -> bool:
    """Whether `keras.layers.Layer.__init__` notes the float32 dtypes users choose."""
    return bool(getattr(keras.layers.Layer.__init__, _FLAG, False))
