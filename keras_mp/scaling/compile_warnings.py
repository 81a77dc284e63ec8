"""What compiling a model says about its precision, once per model.

`keras_mp.scaling.autoscale`'s wrapped `Model.compile` calls `warn_once` after choosing the
optimizer:

- Keras' pure `"float16"`/`"bfloat16"` policies (weights stored low, no float32 master
  copy): the updates the model's weights lose, measured at its learning rate, and for
  bfloat16 Adam/AdamW that `beta_2=0.999` rounds to 1.0, so their step is exactly 0 (the
  loss stays flat, not one weight moves); the fix names `mixed_*` and `lean_bfloat16`.
- Keras' own mixed policies hand `predict()` float16/bfloat16 outputs (probabilities that
  `np.random.choice` refuses): `kmp.convert` or a float32 last layer.
- a converted copy whose source model's layers were frozen or unfrozen after converting
  (`keras_mp.keras_glue.source_handles`).

Models under a keras_mp `Policy` (which warns when made) or converted by keras_mp get only
the last.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np

__all__ = ["low_outputs_message", "pure_weights_message", "warn_once"]

_SAID = "_keras_mp_compile_said"

_PURE_FIX = {
    "bfloat16": "Use 'mixed_bfloat16' (float32 master weights; "
    "keras.mixed_precision.set_global_policy('mixed_bfloat16') before building, or "
    "kmp.convert(model, 'mixed_bfloat16')), or kmp.convert(model, 'lean_bfloat16') for "
    "bfloat16 weights whose updates kmp.LeanOptimizer keeps (about 3 bytes a parameter).",
    "float16": "Use 'mixed_float16' (float32 master weights and a loss scale; "
    "keras.mixed_precision.set_global_policy('mixed_float16') before building, or "
    "kmp.convert(model, 'mixed_float16')).",
}


def _learning_rate(opt) -> float | None:
    try:
        return float(keras.ops.convert_to_numpy(opt.learning_rate))
    except Exception:  # noqa: BLE001 - a schedule or a callable that cannot say yet
        return None


def _share_lost(variables, dtype: str, step: float) -> float:
    """The share of the weights (up to 65,536 values of each) that an update of size
    `step` leaves unchanged in `dtype`."""
    from keras_mp.formats import update_is_lost

    lost = total = 0
    for v in variables:
        w = keras.ops.convert_to_numpy(keras.ops.cast(v.value, "float32")).ravel()[:65536]
        lost += int(np.count_nonzero(update_is_lost(w, step, dtype)))
        total += w.size
    return lost / max(total, 1)


def pure_weights_message(model: keras.Model, lean: bool = False) -> str | None:
    """A warning for a model trained with its weights stored in float16 or bfloat16 and
    no float32 master copy (Keras' pure `"float16"`/`"bfloat16"` policies), else None.

    Under `"lean_bfloat16"` (kmp.LeanOptimizer keeps the updates) it is None.

    Args:
        model: A compiled Keras model.
        lean: whether the model trains lean bfloat16 weights (`kmp.LeanOptimizer`).

    Returns:
        The message (what is lost, measured on the model's weights at its learning rate,
        and the fix), or None.
    """
    from keras_mp.formats import round_to

    if lean:
        return None
    low = [v for v in model.trainable_variables if v.dtype in ("float16", "bfloat16")]
    if not low:
        return None
    dtype = "bfloat16" if any(v.dtype == "bfloat16" for v in low) else "float16"
    mine = [v for v in low if v.dtype == dtype]
    bits = {"bfloat16": 8, "float16": 11}[dtype]
    what = (
        f"Model {model.name!r} trains {len(mine)} weight(s) stored in {dtype} with no float32 "
        f"master copy (a pure {dtype!r} policy): an update smaller than half a weight's "
        f"spacing ({dtype} keeps {bits} significant bits: 2^-{bits} of |w|) is rounded away, "
        "so small steps change nothing and the loss can stay flat."
    )
    lr = _learning_rate(model.optimizer)
    beta_2 = getattr(model.optimizer, "beta_2", None)
    if isinstance(beta_2, float) and round_to(beta_2, dtype) == 1.0:
        # Keras' Adam/AdamW compute their step in the variable's dtype
        what += (
            f" Worse, {type(model.optimizer).__name__}'s beta_2={beta_2:g} rounds to 1.0 in "
            f"{dtype}, so its bias-corrected step lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) is "
            "exactly 0: no weight changes at all."
        )
    elif lr is not None and lr > 0:
        share = _share_lost(mine, dtype, lr)
        what += (
            f" At this learning rate ({lr:g}), a step of that size leaves {100 * share:.0f}% "
            "of them unchanged."
        )
    if dtype == "float16":
        what += " Nothing scales the loss either: gradients below 6e-8 become 0."
    return f"{what} {_PURE_FIX[dtype]}"


def _keras_mp_policy(model) -> bool:
    import keras_mp.policies as policies

    policy = model.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        policy = policy.default_policy
    return isinstance(policy, policies.Policy) or policies.remembered_policy() is not None


def low_outputs_message(model: keras.Model) -> str | None:
    """A warning for a Functional/Sequential model under Keras' own policy whose outputs
    come out in float16 or bfloat16, else None (a converted model casts them to float32)."""
    policy = model.dtype_policy
    if type(policy) is not keras.DTypePolicy or policy.compute_dtype == "float32":
        return None  # not built under Keras' own low policy (a converted model, a map)
    try:
        outputs = keras.tree.flatten(model.outputs or [])
    except (AttributeError, ValueError):
        return None  # a subclassed model: its outputs are known when it runs
    low = sorted(
        {
            keras.backend.standardize_dtype(t.dtype)
            for t in outputs
            if keras.backend.standardize_dtype(t.dtype) in ("float16", "bfloat16")
        }
    )
    if not low:
        return None
    return (
        f"Model {model.name!r} returns {'/'.join(low)} outputs (Keras' own "
        f"{model.dtype_policy.name!r} policy casts nothing back): predict() hands you "
        "low-precision values, e.g. softmax probabilities that sum to 1 only within ~1e-3 "
        "(np.random.choice raises), and losses or metrics you compute on them lose "
        "precision. Use kmp.convert(model, "
        f"{model.dtype_policy.name!r}), whose model returns float32, or end the model with "
        "keras.layers.Activation('linear', dtype='float32') as Keras' mixed-precision guide "
        "does."
    )


def warn_once(model: keras.Model, lean: bool = False, stacklevel: int = 3) -> None:
    """What compiling `model` should say, each message once per model: pure low-precision
    weights under Keras' own policy (a keras_mp `Policy` said it when it was made),
    low-precision outputs under Keras' own policy, and `trainable` changed on the source of
    a converted copy (`keras_mp.keras_glue.source_handles`, every compile).

    Args:
        model: The model being compiled.
        lean: whether it trains lean bfloat16 weights (no pure-weights warning then).
        stacklevel: passed to `warnings.warn`.
    """
    from keras_mp.keras_glue.source_handles import stale_handles_message

    said = vars(model).get(_SAID)
    if said is None:
        said = set()
        object.__setattr__(model, _SAID, said)
    messages = []
    if not _keras_mp_policy(model):
        messages += [("pure", pure_weights_message(model, lean)), ("outputs", None)]
        if model.built:
            messages[-1] = ("outputs", low_outputs_message(model))
    messages.append((None, stale_handles_message(model)))
    for key, message in messages:
        if message and (key is None or key not in said):
            if key is not None:
                said.add(key)
            warnings.warn(message, UserWarning, stacklevel=stacklevel)
