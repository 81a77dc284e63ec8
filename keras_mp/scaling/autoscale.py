"""Compiling under a keras_mp policy gives keras_mp's loss scaler.

Keras' `Model.compile` wraps the optimizer in its own `LossScaleOptimizer` when the model's
policy is named exactly `"mixed_float16"`, and not at all for a `DTypePolicyMap` model
(`"map_mixed_float16"`, which is what `kmp.convert` makes) or a loaded model whose layers
carry their own float16 policies. Keras' scaler has no bounds: its scale can grow to inf
(every later step skipped) or shrink to 0. `install()` (done by `import keras_mp`) wraps
`Model.compile`: for a model computing in float16 with float32 variables,

- under a keras_mp policy (`kmp.set_global_policy`, a converted model, a `kmp.Policy`),
  the optimizer Keras wraps in its scaler gets `kmp.LossScaleOptimizer` instead;
- where Keras leaves a float16 model unscaled, the optimizer gets `kmp.LossScaleOptimizer`;
- a stock `keras.optimizers.LossScaleOptimizer` passed explicitly is kept, with a warning
  saying what it lacks.

Under the `"lean_bfloat16"` policy (bfloat16 weights), a plain Keras optimizer becomes
`kmp.LeanOptimizer` (float32 updates, stochastic rounding, 4-bit moments): Adam, AdamW and SGD on
its fused path, any other (`"rmsprop"`, Adafactor, Lion...) through its own update on the
decoded state; a wrapper (`LossScaleOptimizer`, `MultiOptimizer`) raises a `ValueError`.

Under `"mixed_bfloat16"`, `"float32"` or `"float8"` (a keras_mp policy in sight, or Keras'
own `"mixed_bfloat16"`) the optimizer becomes `kmp.LossScaleOptimizer(optimizer,
initial_scale=1, dynamic=False)`: nothing is scaled, but a step with a non-finite gradient
changes no weight and no slot, and is counted (`skipped_steps`), as under float16.

`compile(..., auto_scale_loss=False)` turns all of it off, as in Keras. Under Keras' own
`"mixed_float16"` (`keras.mixed_precision.set_global_policy`, no keras_mp policy in sight)
a model with its own `train_step` is treated as under keras_mp's: the scaler Keras wraps
the optimizer in becomes `kmp.LossScaleOptimizer`, which notices a loss that was never
scaled (keras.io's distillation) instead of dividing its gradients by the scale. A plain
Keras model on Keras' `train_step` (which scales its loss) keeps Keras' own wrapping.
A model with its own `train_step` compiled with no optimizer (a GAN's `super().compile()`,
which keeps its optimizers as attributes) is left with Keras' default, unwrapped: those
its `train_step` applies are checked by `keras_mp.scaling.optimizer_guard` instead.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import keras

import keras_mp.scaling.compile_warnings as compile_warnings
from keras_mp.keras_glue.keras_internals import DotNotTrackScope, Trainer

__all__ = [
    "install",
    "stock_scaler_message",
    "wants_keras_mp_scaler",
    "wants_lean_optimizer",
    "wants_skip_only",
]


def _runs_float16(model) -> bool:
    """The model, or one of its layers, computes in float16 with float32 variables."""
    for layer in model._flatten_layers(include_self=True):
        if isinstance(layer, keras.layers.InputLayer):
            continue  # computes nothing: its policy is where the model was built
        if (layer.compute_dtype, layer.variable_dtype) == ("float16", "float32"):
            return True
    return False


def _keras_mp_policy_in_sight(model) -> bool:
    import keras_mp.policies as policies

    if isinstance(model.dtype_policy, (keras.dtype_policies.DTypePolicyMap, policies.Policy)):
        return True
    return policies.remembered_policy() is not None


def wants_keras_mp_scaler(model: keras.Model) -> bool:
    """Whether compiling `model` should give it `kmp.LossScaleOptimizer`.

    True when the model computes in float16 with float32 variables (the model's policy or
    any layer's), whichever policy made it: a keras_mp policy (a `DTypePolicyMap` or
    `kmp.Policy` on the model, or `kmp.set_global_policy`), Keras' own `"mixed_float16"`
    (`keras.mixed_precision.set_global_policy`), or layers carrying their own policies
    (a loaded converted model, which Keras would not wrap at all). Where Keras wraps a
    plain Keras model itself, compile keeps Keras' scaler unless the model has its own
    `train_step` (see the module docstring).

    Args:
        model: A Keras model.

    Returns:
        A bool.
    """
    # Keras' own "mixed_float16" with keras_mp imported too: users arrive with Keras'
    # spelling, and Keras' scaler is unbounded and misses a loss that was never scaled.
    return _runs_float16(model)


def _lean_policy_in_sight(model) -> bool:
    import keras_mp.policies as policies

    def lean(policy) -> bool:
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            policy = policy.default_policy
        return isinstance(policy, policies.Policy) and policy.is_lean

    # the model's own policy or its layers' map
    if any(lean(x.dtype_policy) for x in model._flatten_layers(include_self=True)):
        return True
    remembered = policies.remembered_policy()
    return remembered is not None and remembered.is_lean


def wants_lean_optimizer(model: keras.Model) -> bool:
    """Whether compiling `model` should give it `kmp.LeanOptimizer`: a `"lean_bfloat16"`
    policy is in sight (the model's, its policy map's default, or the global one set by
    `kmp.set_global_policy`) and some trainable weight is stored in bfloat16.

    Args:
        model: A Keras model.

    Returns:
        A bool.
    """
    if not _lean_policy_in_sight(model):
        return False
    return any(v.dtype == "bfloat16" for v in model.trainable_variables)


def wants_skip_only(model: keras.Model) -> bool:
    """Whether compiling `model` should give it `kmp.LossScaleOptimizer(optimizer,
    initial_scale=1, dynamic=False)`: nothing scaled, a non-finite step skipped and counted.

    True for a model that computes in no float16 and stores no lean bfloat16 weights
    (`"mixed_bfloat16"`, `"float32"`, `"float8"`) under a keras_mp policy (the model's, a
    converted model's map, or `kmp.set_global_policy`) or Keras' own `"mixed_bfloat16"`:
    one NaN batch would otherwise reach every weight, as it does in stock Keras.

    Args:
        model: A Keras model.

    Returns:
        A bool.
    """
    if _runs_float16(model) or wants_lean_optimizer(model):
        return False
    return _keras_mp_policy_in_sight(model) or model.dtype_policy.name == "mixed_bfloat16"


def stock_scaler_message(model: keras.Model) -> str | None:
    """A warning when `model` is compiled with Keras' own `LossScaleOptimizer`, else None."""
    from keras_mp.scaling.loss_scale import LossScaleOptimizer

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


def unscaled_train_step_message(model: keras.Model) -> str | None:
    """A warning when `model`'s own `train_step` never calls `scale_loss`, else None.

    Keras' `LossScaleOptimizer` divides every gradient by its scale (32768 at the start):
    gradients of a loss that was never scaled come out 32768 times too small, and the run
    stalls with a finite loss (keras.io's guides write `train_step` without `scale_loss`).
    """
    import inspect

    step = type(model).train_step
    if step is keras.Model.train_step:
        return None
    try:
        source = inspect.getsource(step)
    except (OSError, TypeError):
        return None  # no source to read: say nothing rather than guess
    if "scale_loss" in source:
        return None
    return (
        f"Model {model.name!r} has its own train_step, which never calls "
        "`self.optimizer.scale_loss(loss)`, under Keras' own LossScaleOptimizer: "
        "Keras divides the gradients by the loss scale (32768 at the "
        "start), so this model's updates come out 32768 times too small and training "
        "stalls. Pass the plain optimizer (keras_mp wraps it in kmp.LossScaleOptimizer, "
        "which scales only what was scaled), or scale the loss in train_step."
    )


def _after_compile(model, arguments: dict, optimizer_passed: bool = True) -> None:
    import keras_mp.scaling.optimizer_guard as optimizer_guard
    from keras_mp.lean import LeanOptimizer
    from keras_mp.scaling.loss_scale import LossScaleOptimizer

    opt = getattr(model, "optimizer", None)
    if opt is None or isinstance(opt, LeanOptimizer):
        return
    compile_warnings.warn_once(model, lean=wants_lean_optimizer(model), stacklevel=4)
    if not optimizer_passed and type(model).train_step is not keras.Model.train_step:
        # `super().compile()` in a GAN's own `compile`: Keras' default "rmsprop", which the
        # user never wrote and the model's own `train_step` need not use. The optimizers
        # it applies are checked when they first do (`keras_mp.scaling.optimizer_guard`).
        return
    if isinstance(opt, keras.optimizers.LossScaleOptimizer) and wants_lean_optimizer(model):
        raise ValueError(
            f"Model {model.name!r} stores bfloat16 weights (policy 'lean_bfloat16'), which "
            "need no loss scaling: compile it with the inner optimizer (any Keras optimizer; "
            "it becomes kmp.LeanOptimizer) instead of a LossScaleOptimizer."
        )
    if not arguments.get("auto_scale_loss", True):
        optimizer_guard.exempt(opt)  # the user turned it off
        return
    if isinstance(opt, LossScaleOptimizer):
        return
    if wants_lean_optimizer(model):
        from keras_mp.numerics.recast import float32_statistics

        with DotNotTrackScope():
            model.optimizer = LeanOptimizer(opt)  # any plain Keras optimizer
        # Normalization statistics made in bfloat16 (layers built under the global policy)
        # would stall: their averages move by less than bfloat16's precision.
        float32_statistics(model)
        # Saved with the model, so loading restores the lean optimizer and its variables.
        model._compile_config.config["optimizer"] = model.optimizer
        return
    if wants_skip_only(model) and not isinstance(opt, keras.optimizers.LossScaleOptimizer):
        with DotNotTrackScope():
            model.optimizer = LossScaleOptimizer(opt, initial_scale=1.0, dynamic=False)
        # Saved with the model: a loaded model (whose layers carry their policies, no
        # keras_mp policy in sight) gets it back with its state.
        model._compile_config.config["optimizer"] = model.optimizer
        return
    if not wants_keras_mp_scaler(model):
        return
    passed = arguments.get("optimizer")
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        if isinstance(passed, keras.optimizers.LossScaleOptimizer):  # the user's choice
            unscaled = unscaled_train_step_message(model)
            if unscaled:
                warnings.warn(unscaled, UserWarning, stacklevel=3)
                opt._keras_mp_warned_unscaled = True  # said here: not again at its apply
            else:
                warnings.warn(stock_scaler_message(model), UserWarning, stacklevel=3)
            optimizer_guard.exempt(opt.inner_optimizer)
            return
        own_step = type(model).train_step is not keras.Model.train_step
        if not _keras_mp_policy_in_sight(model) and not own_step:
            # Keras' own wrapping of plain Keras code, whose `train_step` scales the
            # loss: left as it was (importing keras_mp changes no plain Keras run)
            return
        # A `train_step` of the user's own may never call `scale_loss` (keras.io's
        # distillation): Keras' scaler would divide its gradients by the scale anyway.
        inner = opt.inner_optimizer
    else:
        inner = opt  # Keras did not wrap at all
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
        passed = "optimizer" in bound.arguments
        bound.apply_defaults()
        _after_compile(self, bound.arguments, optimizer_passed=passed)
        if keras.backend.backend() == "jax":
            from keras_mp.lean import in_backward

            in_backward.attach(self)  # LeanOptimizer(update_in_backward=True)
        return result

    compile._keras_mp_autoscale = True
    Trainer.compile = compile
