"""A plain optimizer updating a converted model's weights is told what it misses, once.

`model.compile` gives a converted model keras_mp's optimizers (`keras_mp.scaling.autoscale`), but
users' own training code often brings its own: a GAN's `train_step` applies the two Adams
it keeps as attributes, the JAX guide's loop calls `optimizer.stateless_apply` directly.
Such an optimizer sees none of what the policy needs:

- on the bfloat16 weights of `"lean_bfloat16"` it trains pure bfloat16 (updates below a
  weight's bfloat16 step are rounded away): it should be `kmp.LeanOptimizer(optimizer)`;
- on the weights of layers computing in float16 its gradients are not loss-scaled (small
  ones underflow to zero): it can be `kmp.LossScaleOptimizer(optimizer)`, with the loss
  passed through `optimizer.scale_loss` inside the tape.

`mark(model, policy)` (called by `kmp.convert`) tags the converted model's trainable
variables with what they need; `install()` (done by `import keras_mp`) makes every
Keras optimizer check, the first time it applies gradients, whether its variables carry
such a tag (or are bfloat16 under the global `"lean_bfloat16"` policy, or float32 under a
global `"mixed_float16"`, Keras' as well as keras_mp's), and warn once naming the
wrapper. keras_mp's own wrappers, and the optimizers they wrap, are exempt;
so is an optimizer compiled with `auto_scale_loss=False`.

Keras' own `LossScaleOptimizer` divides every gradient it applies by its loss scale (32768
at the start), whether or not the loss was scaled: a training loop or `train_step` written
for float32 (keras.io's guides) that never calls `optimizer.scale_loss(loss)` gets updates
32768 times too small, and training stalls with a finite loss. `install()` also marks each
`scale_loss` call, and Keras' wrapper warns the first time it applies gradients of a step
that called none (`kmp.LossScaleOptimizer` applies such gradients as they are, with a
warning of its own).
"""

from __future__ import annotations

import functools
import threading
import warnings

import keras

from keras_mp.keras_glue.keras_internals import BaseOptimizer
from keras_mp.scaling.loss_scale_marks import mark_scaled, take_scaled

__all__ = [
    "exempt",
    "install",
    "mark",
    "plain_optimizer_message",
    "uninstall",
    "unscaled_loss_message",
]

LEAN, FLOAT16 = "lean", "float16"
_TAG = "_keras_mp_needs"
_EXEMPT = "_keras_mp_exempt"
_DEPTH = threading.local()  # an optimizer applied inside another's apply is its inner one


def mark(model: keras.Model, policy) -> None:
    """Tags `model`'s trainable variables with what a plain optimizer would miss.

    Args:
        model: a model `kmp.convert` made.
        policy: its `kmp.Policy`.
    """
    for layer in model._flatten_layers(include_self=True):
        for v in layer._trainable_variables:
            if policy.is_lean and v.dtype == "bfloat16":
                setattr(v, _TAG, LEAN)
            elif (layer.compute_dtype, v.dtype) == ("float16", "float32"):
                setattr(v, _TAG, FLOAT16)


def exempt(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """Marks `optimizer` as run by a wrapper that gives it what it needs (no warning).

    Args:
        optimizer: a Keras optimizer.

    Returns:
        `optimizer`.
    """
    setattr(optimizer, _EXEMPT, True)
    return optimizer


def _needs(variables) -> str | None:
    import keras_mp.policies as policies

    remembered = policies.remembered_policy()
    lean_globally = remembered is not None and remembered.is_lean
    # Keras' "mixed_float16" or keras_mp's, set globally: float32 weights of layers built
    # under it compute in float16, however the model was made (not only by kmp.convert).
    current = keras.config.dtype_policy()
    float16_globally = (current.compute_dtype, current.variable_dtype) == ("float16", "float32")
    needs = None
    for v in variables:
        tag = getattr(v, _TAG, None)
        dtype = getattr(v, "dtype", None)
        if tag is None and lean_globally and dtype == "bfloat16":
            tag = LEAN
        elif tag is None and float16_globally and dtype == "float32":
            tag = FLOAT16
        if tag == LEAN:
            return LEAN
        needs = needs or tag
    return needs


def plain_optimizer_message(optimizer, needs: str) -> str:
    """What `optimizer` misses on variables that need `needs` (`"lean"` or `"float16"`)."""
    kind = type(optimizer).__name__
    if needs == LEAN:
        return (
            f"{kind} optimizer {optimizer.name!r} updates bfloat16 weights of a "
            "'lean_bfloat16' model directly: that is pure bfloat16 training (updates below "
            "a weight's bfloat16 step are rounded away; the model may not learn). Wrap it: "
            f"kmp.LeanOptimizer(keras.optimizers.{kind}(...)) keeps the update exact "
            "(compensated float32 arithmetic). See docs/custom-training.md."
        )
    return (
        f"{kind} optimizer {optimizer.name!r} updates weights of a model computing in "
        "float16 without loss scaling: gradients below 6e-8 underflow to zero. Wrap it, "
        f"kmp.LossScaleOptimizer(keras.optimizers.{kind}(...)), and scale the loss inside "
        "the tape with `loss = optimizer.scale_loss(loss)`. See docs/custom-training.md."
    )


def unscaled_loss_message(optimizer) -> str:
    """What Keras' `LossScaleOptimizer` `optimizer` does to gradients of an unscaled loss."""
    scale = getattr(optimizer, "initial_scale", None)
    scale = f"{scale:g}" if isinstance(scale, (int, float)) else "the scale"
    return (
        f"Keras' LossScaleOptimizer {optimizer.name!r} applies gradients of a loss that was "
        "never scaled (`optimizer.scale_loss(loss)` was not called since its last step, as "
        "in a training loop or train_step written for float32): it divides them by the loss "
        f"scale ({scale} at the start), so every update comes out that many times too small "
        "and training stalls. Scale the loss inside the tape, `loss = "
        "optimizer.scale_loss(loss)`, before taking the gradients, or use "
        "kmp.LossScaleOptimizer(inner), which applies gradients of an unscaled loss as "
        "they are (see docs/custom-training.md)."
    )


def _check_scaled(optimizer) -> None:
    """Before Keras' own `LossScaleOptimizer` applies: warns once when no `scale_loss` call
    came since its last step (read while the step is traced, or run eagerly)."""
    if getattr(optimizer, "tells_unscaled_gradients", False):
        return  # kmp.LossScaleOptimizer: applies gradients of an unscaled loss as they are
    scaled = take_scaled(optimizer)
    if scaled or getattr(optimizer, "_keras_mp_warned_unscaled", False):
        return
    optimizer._keras_mp_warned_unscaled = True
    warnings.warn(unscaled_loss_message(optimizer), UserWarning, stacklevel=4)


def _check(optimizer) -> None:
    if getattr(optimizer, "_keras_mp_checked", False) or getattr(optimizer, _EXEMPT, False):
        return
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return
    variables = getattr(optimizer, "_trainable_variables", None) or []
    if not variables:
        return  # not built yet: checked at the next call
    optimizer._keras_mp_checked = True
    needs = _needs(variables)
    if needs is not None:
        warnings.warn(plain_optimizer_message(optimizer, needs), UserWarning, stacklevel=4)


def _guarded(method):
    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        depth = getattr(_DEPTH, "value", 0)
        if depth == 0 and isinstance(self, keras.optimizers.LossScaleOptimizer):
            _check_scaled(self)
        _DEPTH.value = depth + 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            _DEPTH.value = depth
        if depth == 0:
            _check(self)  # after the call: `apply` builds the optimizer on first use
        return result

    guarded._keras_mp_guard = True
    return guarded


def _marking(scale_loss):
    @functools.wraps(scale_loss)
    def marked(self, loss):
        mark_scaled(self)
        return scale_loss(self, loss)

    marked._keras_mp_guard = True
    return marked


def install() -> None:
    """Makes `apply` and `stateless_apply` of every Keras optimizer check once (idempotent).

    Keras' `LossScaleOptimizer` defines its own: they are wrapped too, so that the optimizer
    it wraps (given scaled gradients) counts as applied inside it, and is not checked; its
    `scale_loss` marks the step scaled.
    """
    cls = keras.optimizers.LossScaleOptimizer
    if not getattr(cls.__dict__["scale_loss"], "_keras_mp_guard", False):
        cls.scale_loss = _marking(cls.__dict__["scale_loss"])
    for cls in (BaseOptimizer, keras.optimizers.LossScaleOptimizer):
        for name in ("apply", "stateless_apply"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_keras_mp_guard", False):
                setattr(cls, name, _guarded(method))


def uninstall() -> None:
    """Gives the optimizers Keras' own `apply`, `stateless_apply` and `scale_loss` back
    (idempotent)."""
    for cls in (BaseOptimizer, keras.optimizers.LossScaleOptimizer):
        for name in ("apply", "stateless_apply", "scale_loss"):
            method = cls.__dict__.get(name)
            if method is not None and getattr(method, "_keras_mp_guard", False):
                setattr(cls, name, method.__wrapped__)
