"""Loss scaling: the optimizer wrapper, its rule, and what makes it apply on its own.

- `loss_scale`: `LossScaleOptimizer` (`kmp.LossScaleOptimizer`; `keras_mp.loss_scale`, the
  path before the regroup, issue 53, is this module).
- `loss_scale_rule`: the pure update `(state, grads finite) -> state` every path runs.
- `loss_scale_marks`: marks a loss as scaled, so gradients are unscaled exactly once.
- `grad_finite`: the per-variable finiteness test (sparse gradients included).
- `autoscale`: the compile-time choice (`compile()` under a keras_mp policy gets a scaler).
- `optimizer_guard`: the one-time check that an unwrapped optimizer does not update float16
  or lean bfloat16 weights.
- `compile_warnings`: what compile says once per model (Keras' pure policies, low outputs,
  a converted copy whose source's layers were unfrozen).

The names below are read from `loss_scale` on first use, not imported here: the backend step
(`keras_mp.tf.loss_scale_apply`) and `keras_mp.lean` import this package's rule and
finiteness test, which must not import the optimizer back.
"""

import importlib as _importlib

__all__ = [
    "LossScaleConfig",
    "LossScaleOptimizer",
    "LossScaleState",
    "initial_loss_scale_state",
    "update_loss_scale",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(_importlib.import_module(f"{__name__}.loss_scale"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
