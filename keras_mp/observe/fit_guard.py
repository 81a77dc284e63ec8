"""The divergence check `fit` runs by default on a model that trains in low precision.

A learning rate far too high makes the loss climb under any precision, and under
bfloat16 (or float32 master weights with a skip-only scaler) nothing overflows, so no
loss-scale guard fires: the run goes on for hours at chance accuracy. Users who add
`kmp.callbacks.DivergenceGuard` or `CollapseGuard` are told; users who did not, were not.

`import keras_mp` wraps `keras.Model.fit` (`install()`): when the model computes or keeps
weights in float16/bfloat16 (or trains with keras_mp's optimizers) and the user's callbacks
hold no divergence check of their own, `fit` adds `DivergenceGuard(action="warn")`. It
reads the logged loss (no extra host sync with Keras' asynchronous callbacks, the weights
once when training begins) and, when the loss stays 3x above its best for 10 steps, warns
once naming the learning rate and the fixes. It never stops or changes the run. A float32
model is left as Keras made it.

To stop such a run instead, pass `kmp.callbacks.DivergenceGuard()` (or `CollapseGuard`);
`KERAS_MP_FIT_GUARD=0` turns the default check off, as does `kmp.patches.uninstall()`.

Example:

```python
model = kmp.convert(model, "mixed_bfloat16")
model.compile(keras.optimizers.SGD(1e3), loss)
model.fit(x, y)   # UserWarning: keras_mp's divergence check (fit's default) ...
```
"""

from __future__ import annotations

import functools
import os

import keras

from keras_mp.observe.divergence import DivergenceGuard

__all__ = ["ENV_VARIABLE", "install", "installed", "uninstall", "wants_default_guard"]

ENV_VARIABLE = "KERAS_MP_FIT_GUARD"
_LOW = ("float16", "bfloat16")


class _DefaultGuard(DivergenceGuard):
    """`DivergenceGuard(action="warn")` whose warning says where it came from."""

    warning_prefix = (
        "keras_mp's divergence check (added to fit for a model training in low precision; "
        "pass kmp.callbacks.DivergenceGuard() to stop such a run, or set "
        "KERAS_MP_FIT_GUARD=0 to turn the check off): "
    )


def _turned_off(environ=None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_VARIABLE, "")
    return value.strip().lower() in ("0", "false", "no", "off")


def _low_precision(model) -> bool:
    for layer in model._flatten_layers(include_self=True):
        if layer.compute_dtype in _LOW:
            return True
    return any(v.dtype in _LOW for v in model.trainable_variables)


def _has_check(callbacks) -> bool:
    from keras_mp.observe.collapse_guard import CollapseGuard

    for cb in callbacks:
        if isinstance(cb, DivergenceGuard):
            return True
        if isinstance(cb, CollapseGuard) and cb.divergence:
            return True
    return False


def wants_default_guard(model, callbacks) -> bool:
    """Whether `fit` adds its divergence check: `model` trains in float16/bfloat16,
    `callbacks` (a list, or None) hold no divergence check, and `KERAS_MP_FIT_GUARD` is
    not `0`."""
    if _turned_off() or not isinstance(callbacks, (list, tuple, type(None))):
        return False  # a CallbackList the user built: theirs as it is
    if _has_check(callbacks or ()):
        return False
    try:
        return _low_precision(model)
    except Exception:  # noqa: BLE001 - a model the check cannot read trains as before
        return False


def _guarded_fit(fit):
    @functools.wraps(fit)
    def guarded(self, *args, **kwargs):
        # `callbacks` is fit's sixth parameter (x, y, batch_size, epochs, verbose, callbacks)
        if len(args) > 5:
            callbacks, where = args[5], "positional"
        else:
            callbacks, where = kwargs.get("callbacks"), "keyword"
        if wants_default_guard(self, callbacks):
            added = list(callbacks or ()) + [_DefaultGuard(action="warn")]
            if where == "positional":
                args = args[:5] + (added,) + args[6:]
            else:
                kwargs["callbacks"] = added
        return fit(self, *args, **kwargs)

    guarded._keras_mp_fit_guard = True
    return guarded


def install() -> None:
    """Wraps `keras.Model.fit` (idempotent); see the module docstring."""
    if not installed():
        own = "fit" in keras.Model.__dict__  # Keras' Model inherits it from its trainer
        keras.Model.fit = _guarded_fit(keras.Model.fit)
        keras.Model.fit._keras_mp_own = own


def uninstall() -> None:
    """Gives `keras.Model` Keras' own `fit` back (idempotent)."""
    fit = keras.Model.__dict__.get("fit")
    if fit is not None and getattr(fit, "_keras_mp_fit_guard", False):
        if fit._keras_mp_own:
            keras.Model.fit = fit.__wrapped__
        else:
            del keras.Model.fit


def installed() -> bool:
    """Whether `keras.Model.fit` adds the default divergence check."""
    return bool(getattr(keras.Model.__dict__.get("fit"), "_keras_mp_fit_guard", False))
