"""Compiling under a keras_mp policy gives keras_mp's loss scaler.

Keras' `Model.compile` wraps the optimizer in its own `LossScaleOptimizer` when the model's
policy is named exactly `"mixed_float16"`, and not at all for a `DTypePolicyMap` model
(`"map_mixed_float16"`, which is what `kmp.convert` makes). Keras' scaler has no bounds:
its scale can grow to inf (every later step skipped) or shrink to 0. `install()` (done by
`import keras_mp`) wraps `Model.compile` so that, for a model computing in float16 with
float32 variables under a keras_mp policy (`kmp.set_global_policy`, a converted model, a
layer given a `kmp.Policy`) or under a policy map:

- an optimizer Keras would wrap, or would leave unscaled, is wrapped in
  `kmp.LossScaleOptimizer` with its defaults;
- a stock `keras.optimizers.LossScaleOptimizer` passed explicitly is kept, with a warning
  saying what it lacks.

`compile(..., auto_scale_loss=False)` turns both off, as in Keras. Models under a plain
Keras `"mixed_float16"` with no keras_mp policy in sight keep Keras' behaviour.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import keras
from keras.src.trainers.trainer import Trainer
from keras.src.utils.tracking import DotNotTrackScope

__all__ = ["install", "stock_scaler_message", "wants_keras_mp_scaler"]


def _dtypes(model) -> tuple:
    policy = model.dtype_policy
    return policy.compute_dtype, policy.variable_dtype


def wants_keras_mp_scaler(model: keras.Model) -> bool:
    """Whether compiling `model` should give it `kmp.LossScaleOptimizer`.

    True for a model computing in float16 with float32 variables whose policy is a
    `DTypePolicyMap` or a `kmp.Policy`, or while `kmp.set_global_policy` is in effect.
    """
    if _dtypes(model) != ("float16", "float32"):
        return False
    from keras_mp import policies

    policy = model.dtype_policy
    if isinstance(policy, (keras.dtype_policies.DTypePolicyMap, policies.Policy)):
        return True
    remembered = policies._global["policy"]
    return remembered is not None and keras.config.dtype_policy().name == remembered.base.name


def stock_scaler_message(model: keras.Model) -> str | None:
    """A warning when `model` is compiled with Keras' own `LossScaleOptimizer`, else None."""
    from keras_mp.loss_scale import LossScaleOptimizer

    opt = getattr(model, "optimizer", None)
    if not isinstance(opt, keras.optimizers.LossScaleOptimizer) or isinstance(
        opt, LossScaleOptimizer
    ):
        return None
    return (
        f"Model {model.name!r} is compiled with Keras' own LossScaleOptimizer, whose scale has "
        "no bounds (it can reach inf, skipping every later step, or 0) and no telemetry. Use "
        "kmp.LossScaleOptimizer(keras.optimizers.Adam(...)) or compile under a keras_mp policy "
        "with a plain optimizer (keras_mp then wraps it)."
    )


def _after_compile(model, arguments: dict) -> None:
    from keras_mp.loss_scale import LossScaleOptimizer

    opt = getattr(model, "optimizer", None)
    if opt is None or isinstance(opt, LossScaleOptimizer):
        return
    if not arguments.get("auto_scale_loss", True) or not wants_keras_mp_scaler(model):
        return
    passed = arguments.get("optimizer")
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        if isinstance(passed, keras.optimizers.LossScaleOptimizer):  # the user's choice
            warnings.warn(stock_scaler_message(model), UserWarning, stacklevel=3)
            return
        inner = opt.inner_optimizer  # Keras' automatic wrapping
    else:
        inner = opt  # a policy map: Keras did not wrap at all
    with DotNotTrackScope():
        model.optimizer = LossScaleOptimizer(inner)


def install() -> None:
    """Wraps `keras.Model.compile` once (idempotent); see the module docstring."""
    original = Trainer.compile
    if getattr(original, "_keras_mp_autoscale", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        _after_compile(self, bound.arguments)
        return result

    compile._keras_mp_autoscale = True
    Trainer.compile = compile
