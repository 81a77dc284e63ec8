"""Sublayers a custom layer makes in `__init__` take its saved dtype when it is loaded.

keras.io's `TransformerBlock` ("Text classification with Transformer") makes its
attention, feed-forward network and norms in `__init__` and passes them no `dtype`. Its
`.keras` config saves the block's own dtype (`mixed_float16` after `kmp.convert`), and
Keras makes the block from it, but the sublayers take the global policy (float32): the
block's first call, inside `keras.saving.load_model`, adds float16 to float32 and fails
with a `TypeError` that names neither keras_mp nor the dtypes' origin.

`Layer.from_config` is wrapped so that each layer is made with the global dtype policy set
to its own saved dtype and restored afterwards (Keras' global policy is per thread). A
layer saved with a `DTypePolicyMap` (a keras_hub model) or a quantized policy, or with no
dtype, is made as before; layers that pass their dtype on (Keras' own) are unaffected.
`install()` (done by `import keras_mp`, `keras_mp/keras_glue/patches.py`) makes plain
`keras.saving.load_model` and `keras.models.clone_model` do it, and installs
`keras_mp.saving.plan` (a converted Functional model saves its precision plan and gets it
back on load); `scope()` does it for one load (`kmp.saving.load_model` uses it, so it works
with `KERAS_MP_NO_PATCH=1` too).
"""

from __future__ import annotations

import functools

import keras

import keras_mp.saving.plan as load_plan
from keras_mp.keras_glue.scoped import installed_for_block

__all__ = ["install", "installed", "scope", "uninstall"]

_FLAG = "_keras_mp_sublayer_dtypes"


def _saved_policy(config):
    saved = config.get("dtype") if isinstance(config, dict) else None
    if saved is None:
        return None
    try:
        policy = keras.dtype_policies.get(saved)
    except (TypeError, ValueError):
        return None
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return None
    if policy.quantization_mode is not None:  # float8/int8 layers make their own state
        return None
    if not keras.backend.is_float_dtype(policy.compute_dtype):
        return None  # an `InputLayer`'s "dtype" is its tensor's (int32 token ids): no policy
    return policy


def _wrap(inherited):
    @functools.wraps(inherited)
    def from_config(cls, config):
        policy = _saved_policy(config)
        previous = keras.config.dtype_policy()
        if policy is None or policy.name == previous.name:
            return inherited(cls, config)
        keras.config.set_dtype_policy(policy)
        try:
            return inherited(cls, config)
        finally:
            keras.config.set_dtype_policy(previous)

    setattr(from_config, _FLAG, True)
    return from_config


def _layer_installed() -> bool:
    own = getattr(vars(keras.layers.Layer).get("from_config"), "__func__", None)
    return bool(getattr(own, _FLAG, False))


def installed() -> bool:
    """Whether `keras.layers.Layer.from_config` makes sublayers in their parent's dtype
    (and `keras_mp.saving.plan` is installed)."""
    return _layer_installed() and load_plan.installed()


def install() -> None:
    """Wraps `keras.layers.Layer.from_config` (see the module's docstring) and installs
    `keras_mp.saving.plan`; idempotent."""
    load_plan.install()
    if not _layer_installed():
        inherited = keras.layers.Layer.from_config.__func__
        keras.layers.Layer.from_config = classmethod(_wrap(inherited))


def uninstall() -> None:
    """Gives `keras.layers.Layer` back the `from_config` it inherits and uninstalls
    `keras_mp.saving.plan`; idempotent."""
    load_plan.uninstall()
    if _layer_installed():
        inherited = keras.layers.Layer.from_config.__func__.__wrapped__
        del keras.layers.Layer.from_config
        if keras.layers.Layer.from_config.__func__ is not inherited:  # it had its own
            keras.layers.Layer.from_config = classmethod(inherited)


def scope():
    """`install()` for the duration of a `with` block (nothing to do if installed)."""
    return installed_for_block(install, uninstall, installed)
