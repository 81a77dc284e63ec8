"""`convert`: an existing model, turned into a policy's model.

The model is copied as it is (`keras_mp.conversion.model_copy`: no layer needs to survive a
`get_config()` round trip), then every layer of the copy gets one `DTypePolicyMap`: default
the policy's base dtypes, float32 for the paths the plan pins (`keras_mp.keep_list`).
Keras resolves the map per layer path, and Keras' and keras_hub's configs save it, so the
pins come back when the model is loaded. Layers without a path get their policy directly.
Under a pure float16/bfloat16 policy the variables of the low layers are then recast.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import warnings
from typing import Any

import keras

import keras_mp.keep_list as keep_list
import keras_mp.keras_glue.source_handles as handles
import keras_mp.scaling.optimizer_guard as optimizer_guard
from keras_mp.conversion import calibration
from keras_mp.conversion import runcheck as _runcheck
from keras_mp.conversion.apply import apply_plan, saved_by_a_graph
from keras_mp.conversion.model_copy import copy_model, pair_layers, recast_variables
from keras_mp.policies import DEFAULT_KEEP_FP32, Policy, as_policy, policy_map

__all__ = ["apply_plan", "convert", "plan", "saved_by_a_graph"]


def plan(
    model: keras.Model,
    policy: str | Policy,
    *,
    calibrate: Any = None,
    margin: float = calibration.DEFAULT_MARGIN,
    max_batches: int = 8,
    loss: Any = None,
) -> keep_list.Plan:
    """Which layers of `model` would run in float32 under `policy`, and why.

    The decision `convert` applies: the keep-list, and with `calibrate` the layers that
    leave the compute dtype's range on those batches (see `keras_mp.conversion.calibration`).

    Args:
        model: A built Keras model (the float32 model when calibrating).
        policy: A `Policy` or a policy name.
        calibrate: Optional batches (`x`, `(x, y)`, a list of them, or a dataset).
        margin: Calibration's safety factor: a layer is pinned when a tensor it receives
            or produces exceeds the dtype's largest value / `margin` (float16: 65504 / 4).
        max_batches: At most this many batches of `calibrate` are used.
        loss: With targets in `calibrate`, the gradient range is measured too (default:
            the compiled loss, if any).

    Returns:
        A `keras_mp.keep_list.Plan`: `print` it, or `to_dict()`; its `calibration` holds
        the measurements, the pins' measured maxima against the limit and their cost.

    Example:

    ```python
    print(kmp.plan(model, "mixed_float16", calibrate=x_train[:256]))
    ```
    """
    _check_model(model)
    policy = as_policy(policy)
    if calibrate is None:
        return keep_list.plan(model, policy)
    return _calibrated(model, policy, calibrate, margin, max_batches, loss)[0]


def _check_model(model) -> None:
    if not isinstance(model, keras.Model):
        raise ValueError(f"convert() takes a keras.Model. Received: {type(model).__name__}")
    if model.built:
        return
    # A container never called itself (a subclassed model holding built sub-models) has
    # all its weights in its layers: it converts as it is and is built by its first call.
    layers = model._flatten_layers(include_self=False, recursive=True)
    unbuilt = [x for x in layers if not x.built]
    if layers and not unbuilt:
        return
    what = (
        f"its layer(s) {', '.join(repr(x.path or x.name) for x in unbuilt[:5])}"
        + (f" and {len(unbuilt) - 5} more" if len(unbuilt) > 5 else "")
        + " have no weights yet"
        if unbuilt
        else "it has no layers with weights"
    )
    raise ValueError(
        f"Model {model.name!r} is not built: {what}. Call the model on data or use "
        "model.build(shape) (or build those layers) before convert(), so that there are "
        "weights to carry over."
    )


def _warn_unmatched(model: keras.Model, policy: Policy) -> None:
    """Warns about user-added keep-list entries that match no layer (likely a typo)."""
    outputs = frozenset(id(x) for x in keep_list.output_layers(model))
    layers = model._flatten_layers(include_self=False)
    unmatched = [
        e
        for e in policy.keep_fp32
        if e not in DEFAULT_KEEP_FP32
        and not any(keep_list.entry_matches(e, x, outputs) for x in layers)
    ]
    if unmatched and policy.is_low_precision:
        warnings.warn(
            f"keep_fp32 entries {unmatched} match no layer of model {model.name!r}.",
            UserWarning,
            stacklevel=3,
        )


def _warn_chose_float32(model: keras.Model, policy: Policy) -> None:
    """Warns about layers made with `dtype="float32"` under a float32 global policy, where
    only some layers were: a pin, maybe, which `convert` cannot tell from a helper's
    `dtype` argument (`keep_list.user_pins`), so it names them and the way to keep them."""
    from keras_mp.keep_list.user_pins import chose_float32

    if not policy.is_low_precision:
        return
    layers = keep_list.layer_tree(model)[0]
    chosen = [x for x in layers if chose_float32(x)]
    weighted = [x for x in layers if x._trainable_variables or x._non_trainable_variables]
    if not chosen or len(chosen) >= len(weighted):
        return  # none, or the whole model: its dtype, not a pin
    where = keep_list.addresses(model)
    names = [where[id(x)] for x in chosen]
    shown = ", ".join(repr(n) for n in names[:5]) + (" ..." if len(names) > 5 else "")
    warnings.warn(
        f"Layer(s) {shown} of model {model.name!r} were made with dtype='float32' under a "
        f"float32 global policy, like the rest of the model as far as Keras can tell: "
        f"convert runs them in {policy.compute_dtype} with the others. To keep them "
        f"float32, add them to the keep-list: kmp.Policy({policy.name!r}, keep_fp32=["
        f"*kmp.DEFAULT_KEEP_FP32, {', '.join(repr(n) for n in names[:3])}]) (or make them "
        "float32 under the low-precision global policy).",
        UserWarning,
        stacklevel=3,
    )


def _warn_stock_scaler(model: keras.Model) -> None:
    from keras_mp.scaling.autoscale import stock_scaler_message

    message = stock_scaler_message(model)
    if message:
        warnings.warn(message, UserWarning, stacklevel=3)


def convert(
    model: keras.Model,
    policy: str | Policy | keep_list.Plan,
    *,
    calibrate: Any = None,
    margin: float = calibration.DEFAULT_MARGIN,
    max_batches: int = 8,
    loss: Any = None,
    check: str | None = "auto",
    in_place: bool = False,
    fused_loss: bool = False,
) -> keras.Model:
    """Returns a copy of `model` running under `policy`, with its weights.

    Every layer runs in the policy's compute dtype except what its keep-list pins to
    float32 (see `kmp.DEFAULT_KEEP_FP32` and `keras_mp.keep_list`): a pin covers the
    layer's sublayers, a pin inside a block is lifted to the block, and `"output"` pins a
    head, never the last block of a backbone. Stock `MultiHeadAttention`/`Softmax` layers of
    a Functional or Sequential graph become their `keras_mp.layers` versions (softmax in
    float32), Keras' `LayerNormalization` gets keras_mp's fused kernel and Keras' GELU
    keras_mp's (same math). The decision is `kmp.plan(model, policy)`, and the result's
    `precision_plan` attribute.

    With `calibrate` (a few batches of the user's data), the layers that receive or produce
    a tensor past the compute dtype's largest value / `margin` on those batches are pinned
    too, and the converted model is checked on them (see
    `keras_mp.conversion.calibration`); the plan
    reports each pin's measured maximum against the limit and the FLOPs moved to float32.

    The converted model is then run once on a batch (`check`, on by default: the first
    calibration batch, or one made from the model's input specs), compiled as `predict`
    runs it: a layer that cannot run in the compute dtype (an op without a float16 kernel,
    a dtype error inside the layer) is pinned to float32 alone, its sublayers left as they
    were, and the model converted and run again, until it runs (see `keras_mp.conversion.runcheck`).
    One compiled gradient step runs too (`check="train"`, or by default on TensorFlow
    when a layer resizes bilinearly in the low dtype), and layers whose backward XLA cannot
    compile in the low dtype are pinned. Each such pin's reason is the error it fixed; the
    plan's `check` reports them and their share of the FLOPs.

    Any model Keras runs converts: the model is copied as it is (no `get_config()` round
    trip of its layers), so keras_hub backbones and tasks, `keras.applications`, Functional,
    Sequential and subclassed models, nested models and shared layers all work, and FP32
    master weights are bit-identical. Under pure `"float16"`/`"bfloat16"` the copy's
    variables are recast to the low dtype (pinned layers keep float32). A model Python
    cannot copy is rebuilt from its config and each weight carried over by path. The
    original is not modified. The pins are part of the saved model: every layer's dtype is
    one `DTypePolicyMap`, which Keras and keras_hub save and rebuild on load. If the model
    was compiled, the copy is compiled from the same config; under `"mixed_float16"` that
    (and any later `compile`) gives it `kmp.LossScaleOptimizer` (see `keras_mp.scaling.autoscale`).

    Args:
        model: A built Keras model (the float32 model when calibrating).
        policy: A `Policy`, a policy name, or a `Plan` from `kmp.plan`.
        calibrate: Optional batches: `x`, `(x, y)`, a list of them, or a dataset.
        margin: Calibration's safety factor (float16: pin past 65504 / 4 = 16,376).
        max_batches: At most this many batches of `calibrate` are used.
        loss: With targets in `calibrate`, the gradient range is checked too (default: the
            compiled loss, if any).
        check: `"forward"`: run the converted model once and pin the layers that raise
            in the compute dtype; `"train"`: also compile one gradient step (XLA on
            TensorFlow) and pin what fails there; `"auto"` (default): `"train"` on
            TensorFlow for a model with a bilinear resizing layer in the low dtype, else
            `"forward"`; None: no run check. Not run for a `Plan` (applied as it is) or a
            float32 policy.
        in_place: Convert `model` itself rather than a copy, so that the handles you
            keep on its layers (keras.io's transfer-learning `base_model`, later
            unfrozen) are the trained model's. The run check and calibration still try
            their conversions on copies; the plan they settle on is applied to `model`
            (its variables recast where the policy stores them in another dtype; a
            compiled model is compiled again, with fresh optimizer state). Default
            False: the original is not touched, and a `trainable` flag changed on its
            layers afterwards is named by a warning when the copy is compiled.
        fused_loss: train and evaluate the copy with the cross-entropy taken from the
            hidden states chunk by chunk, never the whole logits
            (`kmp.use_fused_loss`; keras_hub causal LMs and models ending in a
            `ReversibleEmbedding` or a bias-free `Dense`). Not saved with the model.

    Returns:
        A new, built `keras.Model` of the same class (`in_place`: `model`).

    Raises:
        ValueError: for an unknown policy name, an unbuilt model, a model that can be
            neither copied nor rebuilt (the message names the reason), or a layer that
            fails in the compute dtype though pinned (the message names it).

    Example:

    ```python
    model = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3))
    mixed = kmp.convert(model, "mixed_bfloat16")
    mixed.get_layer("predictions").compute_dtype   # 'float32' (a softmax head)
    ```
    """
    _check_model(model)
    if fused_loss:
        from keras_mp.numerics.fused_lm_loss import fused_head

        fused_head(model)  # refused before the conversion's work, naming the output
    _warn_stock_scaler(model)  # here, once: the run check's conversions run with warnings off
    if check not in (None, *_runcheck.CHECKS):
        raise ValueError(
            f"convert: `check` must be one of {[*_runcheck.CHECKS, None]}. Received: {check!r}"
        )
    if isinstance(policy, keep_list.Plan):
        if calibrate is not None:
            raise ValueError("convert: pass `calibrate` to kmp.plan, or a policy, not a plan.")
        return _with_fused_loss(_converted(model, policy, in_place=in_place), fused_loss)
    if in_place:  # the checks' conversions are copies; the plan they settle on, in place
        tried = convert(
            model,
            policy,
            calibrate=calibrate,
            margin=margin,
            max_batches=max_batches,
            loss=loss,
            check=check,
        )
        new = _converted(model, tried.precision_plan, in_place=True)
        return _with_fused_loss(new, fused_loss)
    policy = as_policy(policy)
    _warn_unmatched(model, policy)
    _warn_chose_float32(model, policy)
    x, inputs = None, ""
    if calibrate is None:
        the_plan, new = keep_list.plan(model, policy), None
    else:
        the_plan, new = _calibrated(model, policy, calibrate, margin, max_batches, loss)
        x, inputs = calibration.batches(calibrate, 1)[0][0], "calibration batch"
    if check is None or not policy.is_low_precision:
        new = new if new is not None else _converted(model, the_plan)
        return _with_fused_loss(new, fused_loss)
    recalibrate = (
        None
        if calibrate is not None
        else (lambda batch: _calibrated(model, policy, batch, margin, 1, loss)[0])
    )
    new = _runcheck.run_check(
        model, the_plan, new, x, inputs, check, lambda p: _converted(model, p), recalibrate
    )
    return _with_fused_loss(new, fused_loss)


def _with_fused_loss(model: keras.Model, fused_loss: bool) -> keras.Model:
    """`model`, trained with `kmp.use_fused_loss` where `fused_loss` asks for it."""
    if not fused_loss:
        return model
    from keras_mp.numerics.fused_lm_loss import use_fused_loss

    return use_fused_loss(model)


def _converted(model: keras.Model, the_plan: keep_list.Plan, in_place: bool = False) -> keras.Model:
    """A copy of `model` running under `the_plan` (`in_place`: `model` itself)."""
    policy = the_plan.policy
    if in_place:
        new, copied = model, True
    else:
        try:
            new, copied = copy_model(model)
        except ValueError as e:
            raise ValueError(f"convert: {e}") from e
        handles.record(model, new, pair_layers(model, new))
    if not copied:  # rebuilt from its config: paths may differ from the source's
        the_plan = _translate(the_plan, model, new)
    apply_plan(new, the_plan, _runcheck.alone(policy_map(policy, the_plan, new), the_plan, new))
    _save_the_dtype(new)
    # Every weight to its layer's variable dtype: low under a pure policy, and float32
    # master weights where the source stored bfloat16 ones (a lean model: exact).
    recast_variables(new, trainable_only=policy.is_lean)
    if policy.name == "float8":
        from keras_mp.float8.layers import apply_float8
        from keras_mp.float8.payoff import warn_if_float8_will_not_pay

        apply_float8(new, policy.float8_recipe)  # the output layers stay bfloat16
        warn_if_float8_will_not_pay(new)  # a user should not lose 30% without a word
    optimizer_guard.mark(new, policy)  # a plain optimizer on these weights warns
    _compile_like(model, new, policy)
    new.precision_plan = the_plan
    return new


def _config_with_dtype(self) -> dict:
    return {
        **type(self).get_config(self),
        "dtype": keras.dtype_policies.serialize(self.dtype_policy),
    }


def _save_the_dtype(model: keras.Model) -> None:
    """Models whose `get_config()` drops their dtype (keras_hub's VGG backbone does not call
    `super().get_config()`) would load back in float32: their config gets the policy map,
    where their constructor takes a `dtype` (directly or through `**kwargs`). A config that
    writes some other dtype is left alone (Moonshine's constructor cannot take a map)."""
    for m in [model, *keep_list.layer_tree(model)[0]]:
        if not isinstance(m, keras.Model) or keep_list.serializes_its_layers(m):
            continue
        if not isinstance(m.dtype_policy, keras.dtype_policies.DTypePolicyMap):
            continue
        if isinstance(getattr(m, "backbone", None), keras.Model):
            continue  # a keras_hub task: its layers take the dtype its backbone saves
        try:
            config = m.get_config()
            params = inspect.signature(type(m).__init__).parameters.values()
        except Exception:  # noqa: BLE001 - a model that cannot say: leave it as it is
            continue
        takes_dtype = any(p.name == "dtype" or p.kind is p.VAR_KEYWORD for p in params)
        if isinstance(config, dict) and "dtype" not in config and takes_dtype:
            # A bound method: copies of the model (copy_model) rebind it to themselves.
            object.__setattr__(m, "get_config", types.MethodType(_config_with_dtype, m))


def _compile_like(model: keras.Model, new: keras.Model, policy: Policy) -> None:
    """Compiles `new` as `model` was, with fresh optimizer state. `Trainer.compile` is
    called directly: Keras' `compile_from_config` gives up on classes that override
    `compile` (every keras_hub task), though what they recorded are its arguments."""
    config = model.get_compile_config() if model.compiled else None
    if config is None:
        return
    from keras_mp.keras_glue.keras_internals import Trainer
    from keras_mp.lean import LeanOptimizer

    config = keras.saving.deserialize_keras_object(config)
    optimizer = config.get("optimizer")
    if isinstance(optimizer, LeanOptimizer) and not policy.is_lean:
        # a lean model converted to float32 weights: its plain optimizer, which the
        # policy's own wrapping (`keras_mp.scaling.autoscale`) then gets
        config["optimizer"] = optimizer.plain_optimizer()
    elif getattr(optimizer, "skip_only", False):
        # the fixed scale of 1 compile gave a bfloat16 or float32 model: the new policy
        # wraps the plain optimizer its own way (float16: a dynamic scale)
        config["optimizer"] = optimizer.inner_optimizer
    Trainer.compile(new, **config)


def _calibrated(model, policy: Policy, data, margin, max_batches, loss=None) -> tuple:
    """(plan with calibration pins, converted model checked on the batches or None)."""
    return calibration.calibrated_plan(
        model, policy, data, margin, max_batches, loss, lambda p: _converted(model, p)
    )


def _translate(the_plan: keep_list.Plan, model: keras.Model, new: keras.Model):
    """`the_plan` with `model`'s layer addresses replaced by their counterparts' in `new`."""
    old_where, new_where = keep_list.addresses(model), keep_list.addresses(new)
    moved = {
        old_where[id(a)]: new_where[id(b)]
        for a, b in pair_layers(model, new)
        if id(a) in old_where and id(b) in new_where
    }
    if all(k == v for k, v in moved.items()):
        return the_plan
    return dataclasses.replace(
        the_plan,
        pins=[dataclasses.replace(p, path=moved.get(p.path, p.path)) for p in the_plan.pins],
        swaps={moved.get(k, k): v for k, v in the_plan.swaps.items()},
        float32={moved.get(a, a) for a in the_plan.float32},
    )
