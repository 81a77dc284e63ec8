"""What `import keras_mp` changes in Keras for every model in the process, and undoing it.

`import keras_mp` calls `install()`, which changes Keras for every model in the process,
converted or not:

- `keras.Model.compile` is wrapped (`keras_mp.scaling.autoscale`): under a keras_mp policy (or a
  float16 model Keras leaves unscaled) the optimizer becomes `kmp.LossScaleOptimizer`,
  under `"lean_bfloat16"` `kmp.LeanOptimizer`; a float32 or bfloat16 model under a keras_mp
  policy gets a skip-only scaler. A model compiled under none of them is left as Keras
  made it; `compile(..., auto_scale_loss=False)` turns it off for one model.
- every Keras optimizer's `apply` and `stateless_apply` check once, on first use, that
  they do not update float16 or lean bfloat16 weights unwrapped (`keras_mp.scaling.optimizer_guard`:
  one warning, nothing changed).
- Keras' own `LossScaleOptimizer` marks each `scale_loss` call and warns, the first time it
  applies gradients of a step that made none (a loop written for float32), that it divides
  them by the loss scale: updates 32768 times too small (`keras_mp.scaling.optimizer_guard`).
- `keras.Model.fit` adds `DivergenceGuard(action="warn")` to the callbacks of a model
  training in float16/bfloat16 that has no divergence check of its own: a learning rate far
  too high gets one warning naming it; the run is not changed (`keras_mp.observe.fit_guard`;
  `KERAS_MP_FIT_GUARD=0` turns it off).
- `keras.models.clone_model` warns once when the model it copies has bfloat16 weights: a
  moving average kept in the copy and updated with `assign` stalls in bfloat16
  (`keras_mp.lean.ema`; `kmp.lean.ema_update` is the fix). The copy is made as before.
- `Layer.from_config` makes each layer with the global dtype policy set to its saved
  dtype, so the sublayers a custom layer makes in `__init__` load in its dtype, not in
  float32 beside a float16 parent (`keras_mp.saving.sublayer_dtypes`).
- `Layer.__init__` notes on a layer a float32 dtype its maker chose: float32 under a low
  global policy, which `kmp.convert` keeps (its plan says "set by the user"), or
  `dtype="float32"` under a float32 one, which `convert`'s warning names
  (`keras_mp.keep_list.user_pins`). The layer is made as before.
- `keras.layers.Normalization.adapt` gathers its statistics in float32 where the layer
  computes in float16/bfloat16 (Keras' own fails there on a dataset), and warns when the
  data reach past the compute dtype's range, naming `dtype="float32"`
  (`keras_mp.numerics.normalization_adapt`).
- `Layer.add_loss` casts a float16/bfloat16 loss to float32, and Keras' built-in
  regularizers compute from float32: `model.losses` is float32 under every policy
  (`keras_mp.numerics.added_losses`).
- `keras.initializers.Orthogonal` draws float16/bfloat16 weights in float32 and casts them
  (neither backend has a low-precision QR: an `LSTM` cannot be built under pure `"float16"`
  on JAX, nor with bfloat16 variables anywhere) (`keras_mp.numerics.initializers`).
- on TensorFlow, `tf.distribute`'s collective broadcasts send the bfloat16, int8 and uint8
  values TensorFlow refuses as float32/int32 (`keras_mp.tf.distribute`); others untouched.
- where keras_mp is what imports TensorFlow and `TF_CPP_MIN_LOG_LEVEL` is unset, it is set
  to `"1"`: TensorFlow's C++ INFO lines (oneDNN, CUDA stubs, CPU features, XLA) are hidden,
  its warnings and errors kept (set the variable yourself to choose). The lines TensorFlow
  writes while it loads, before it reads the level, are filtered from stderr during that
  import, as the `keras-mp` command does (`keras_mp.keras_glue.backend_logs`).

To opt out, set `KERAS_MP_NO_PATCH=1` before `import keras_mp` (none of it is done), or
call `kmp.patches.uninstall()` (`compile` and the optimizers' `apply` are Keras' own again;
the broadcast widening stays, as it only changes what TensorFlow would refuse). Then pass
the optimizer yourself: `kmp.LossScaleOptimizer(...)` for float16, `kmp.LeanOptimizer(...)`
for `"lean_bfloat16"`.

Example:

```python
import keras_mp as kmp

kmp.patches.installed()   # {'compile': True, 'optimizer_apply': True, ...}
kmp.patches.uninstall()   # Keras' compile and apply, as without keras_mp
kmp.patches.install()     # back
```
"""

from __future__ import annotations

import os
import sys

__all__ = [
    "NO_PATCH_VARIABLE",
    "disabled",
    "install",
    "installed",
    "quiet_tensorflow_info",
    "start_quietly",
    "uninstall",
]

NO_PATCH_VARIABLE = "KERAS_MP_NO_PATCH"
_APPLY = ("apply", "stateless_apply")


def disabled(environ=None) -> bool:
    """Whether `KERAS_MP_NO_PATCH` is set to a true value (`1`, `true`, `yes`, `on`)."""
    value = (os.environ if environ is None else environ).get(NO_PATCH_VARIABLE, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def quiet_tensorflow_info(environ=None) -> bool:
    """Sets `TF_CPP_MIN_LOG_LEVEL=1` (INFO hidden) where TensorFlow is not imported yet and
    the user set no level. Returns whether it set it."""
    environ = os.environ if environ is None else environ
    if "tensorflow" in sys.modules or "TF_CPP_MIN_LOG_LEVEL" in environ or disabled(environ):
        return False
    environ["TF_CPP_MIN_LOG_LEVEL"] = "1"
    return True


def start_quietly() -> None:
    """Imports Keras and its backend with stderr captured, passing on all but TensorFlow's
    C++ log lines below `TF_CPP_MIN_LOG_LEVEL` (some are written before TensorFlow reads
    the level); on TensorFlow also lists its devices, where it looks for CUDA and says there
    is none. What the `keras-mp` command does, at the level `quiet_tensorflow_info` set."""
    from keras_mp.keras_glue.backend_logs import captured_stderr, log_level

    with captured_stderr(log_level()):
        import keras

        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            tf.config.list_physical_devices()


# Imported by keras_mp's `__init__` before anything imports Keras (and so TensorFlow).
if quiet_tensorflow_info():
    start_quietly()


def install() -> None:
    """Wraps Keras' `compile` and the optimizers' `apply` (and, on TensorFlow, widens the
    collective broadcasts); idempotent. `import keras_mp` calls it unless
    `KERAS_MP_NO_PATCH` is set."""
    import keras

    import keras_mp.keep_list.user_pins as user_pins
    import keras_mp.lean.ema as lean_ema
    import keras_mp.numerics.added_losses as added_losses
    import keras_mp.numerics.initializers as initializers
    import keras_mp.numerics.normalization_adapt as normalization_adapt
    import keras_mp.saving.sublayer_dtypes as sublayer_dtypes
    import keras_mp.scaling.autoscale as autoscale
    import keras_mp.scaling.optimizer_guard as optimizer_guard
    from keras_mp.observe import fit_guard

    autoscale.install()
    fit_guard.install()
    optimizer_guard.install()
    lean_ema.install()
    sublayer_dtypes.install()
    user_pins.install()
    normalization_adapt.install()
    added_losses.install()
    initializers.install()
    if keras.backend.backend() == "tensorflow":
        from keras_mp.tf.distribute import widen_collective_broadcasts

        widen_collective_broadcasts()


def uninstall() -> None:
    """Gives Keras back its own `Model.compile` and optimizers' `apply`/`stateless_apply`;
    idempotent. Models compiled before keep the optimizer they were given."""
    import keras_mp.keep_list.user_pins as user_pins
    import keras_mp.lean.ema as lean_ema
    import keras_mp.numerics.added_losses as added_losses
    import keras_mp.numerics.initializers as initializers
    import keras_mp.numerics.normalization_adapt as normalization_adapt
    import keras_mp.observe.fit_guard as fit_guard
    import keras_mp.saving.sublayer_dtypes as sublayer_dtypes
    import keras_mp.scaling.optimizer_guard as optimizer_guard
    from keras_mp.keras_glue.keras_internals import Trainer

    added_losses.uninstall()
    initializers.uninstall()
    user_pins.uninstall()
    normalization_adapt.uninstall()
    lean_ema.uninstall()
    sublayer_dtypes.uninstall()
    compile_ = Trainer.compile
    if getattr(compile_, "_keras_mp_autoscale", False):
        Trainer.compile = compile_.__wrapped__
    optimizer_guard.uninstall()
    fit_guard.uninstall()


def installed() -> dict:
    """What is installed now: `{"compile": bool, "optimizer_apply": bool,
    "collective_broadcasts": bool or None, "clone_model": bool, "sublayer_dtypes": bool,
    "user_pins": bool, "normalization_adapt": bool, "added_losses": bool,
    "fit_guard": bool, "orthogonal_float32": bool}`
    (None: TensorFlow is not imported)."""
    import keras_mp.keep_list.user_pins as user_pins
    import keras_mp.lean.ema as lean_ema
    import keras_mp.numerics.added_losses as added_losses
    import keras_mp.numerics.initializers as initializers
    import keras_mp.numerics.normalization_adapt as normalization_adapt
    import keras_mp.saving.sublayer_dtypes as sublayer_dtypes
    from keras_mp.keras_glue.keras_internals import BaseOptimizer, Trainer
    from keras_mp.observe import fit_guard

    out = {
        "compile": bool(getattr(Trainer.compile, "_keras_mp_autoscale", False)),
        "optimizer_apply": all(
            getattr(getattr(BaseOptimizer, n), "_keras_mp_guard", False) for n in _APPLY
        ),
        "collective_broadcasts": None,
        "clone_model": lean_ema.installed(),
        "sublayer_dtypes": sublayer_dtypes.installed(),
        "user_pins": user_pins.installed(),
        "normalization_adapt": normalization_adapt.installed(),
        "added_losses": added_losses.installed(),
        "orthogonal_float32": initializers.installed(),
        "fit_guard": fit_guard.installed(),
    }
    if "tensorflow" in sys.modules and sys.modules["tensorflow"] is not None:
        from tensorflow.python.ops import collective_ops

        out["collective_broadcasts"] = bool(
            getattr(collective_ops.broadcast_send, "_keras_mp_widened", False)
        )
    return out
