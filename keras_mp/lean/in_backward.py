"""The lean update inside the backward pass (JAX): no whole-model gradient is ever held.

With `kmp.LeanOptimizer(optimizer, update_in_backward=True)` on the JAX backend, a
model's `fit` runs `train_step` below instead of Keras' own: each weight's lean update
(`keras_mp.lean.rule.lean_rule`, the ordinary step's rule) runs in the backward pass as
soon as that weight's gradient is made, so the gradient dies there instead of being held
with every other one until the optimizer runs (13.46 GiB of bfloat16 gradients at the
peak of a Llama-3-8B step, BENCHMARKS 22).

The route (jax issue 30338): every large weight enters the forward pass through an
identity with a custom VJP (`jax.custom_vjp`) that also takes the weight's lean state;
its backward rule receives the weight's gradient, runs the weight's update and hands the
NEW weight and state back as the "cotangents" of the weight and state. The step returns
them as the new variables; Keras' train function donates the old ones, so XLA can write
the new values in place. Integer state (the 4-bit moments' codes, `kahan`'s int8
compensation) travels as `float8_e4m3fn` of the same bits (a cotangent must be a float).

What the step guarantees, as the ordinary lean step does (tests/test_lean_in_backward.py):

- **a non-finite step never reaches the weights**: a first backward pass reduces each
  weight's gradient, as it is made, to its float32 sum of squares and a finiteness flag
  (nothing else is kept; LOMO's two passes); the updating second pass gets the step's
  finiteness, and with one inf or NaN anywhere every weight and moment keeps its stored
  bits, the step is counted in `skipped_steps` and not in `iterations`;
- **clipping is exact**: `global_clipnorm` scales by the first pass's global norm, the
  sum of the per-weight sums in Keras' order; `clipnorm` and `clipvalue` act on each
  gradient alone;
- the same learning rate (schedules of `iterations`), weight decay, stochastic rounding
  noise and bias correction as the ordinary step: its weights and state are the ordinary
  step's, bit for bit where XLA fuses the same arithmetic alike (the tests' tolerance).

XLA would undo this three ways, each seen in a compiled Llama-3-8B step (BENCHMARKS 23): by
merging the two passes' identical matmuls (an `optimization_barrier` between the passes
forbids it), by fusing the alike updates of many layers into one kernel that waits for the
last of their gradients (each update reads its inputs through a barrier of its own;
`keras_mp.lean.backward_tags`), and by scheduling the updates late (one token threads them
in the order the forward pass first reads the weights). Compiled for one H200, Llama-3-8B's
step goes from 34.91 to 31.42 GiB; XLA still holds activation gradients in the backward pass.

The weights in packed groups (`pack_small`: biases, norm scales, small kernels, each
under 65536 values) are updated after the backward pass, as ordinarily: their gradients
are small. The cost is the first pass (a forward and a backward pass more: about 2x the
ordinary step's compute; `benchmarks/in_backward_speed.py`).

Refused, with the reason: the TensorFlow backend (its gradients are made by a tape all at
once), `gradient_accumulation_steps` (accumulating needs every gradient held), optimizers
on the general path (only Adam, AdamW and SGD's fused rule runs per weight), a
`keras.distribution` or `shard_over_data` (not built yet), and a model with its own
`train_step`.
"""

from __future__ import annotations

import functools

import keras
from keras import ops

from keras_mp.keras_glue import keras_internals
from keras_mp.lean.backward_tags import (
    chained,
    first_reads,
    from_carrier,
    stats_tag,
    to_carrier,
    update_tag,
)
from keras_mp.lean.rule import to_float32

__all__ = ["attach", "check", "train_step"]

_NAME = "LeanOptimizer(update_in_backward=True)"


def check(optimizer) -> None:
    """Raises a `ValueError` naming why `optimizer` cannot update inside the backward
    pass (see the module docstring); returns None where it can.

    Args:
        optimizer: a `LeanOptimizer`.
    """
    backend = keras.backend.backend()
    if backend != "jax":
        raise ValueError(
            f"{_NAME} runs on the JAX backend only (KERAS_BACKEND=jax); on {backend} the "
            "gradients are all made before any update."
        )
    if optimizer.gradient_accumulation_steps:
        raise ValueError(
            f"{_NAME}: gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps} cannot be combined with it: "
            "accumulating keeps every gradient over the steps, which the update inside the "
            "backward pass exists not to hold. Use a larger batch, or leave "
            "update_in_backward off."
        )
    if optimizer.general:
        raise ValueError(
            f"{_NAME}: {optimizer.kind} runs on the general path, which updates all "
            "variables at once; only Adam, AdamW and SGD update each weight on its own."
        )
    if optimizer.shard_over_data:
        raise ValueError(f"{_NAME}: shard_over_data is not supported with it yet.")


def attach(model) -> bool:
    """Makes `model`'s `fit` run `train_step` where its optimizer asks for it.

    Called by keras_mp's `compile` (`keras_mp.scaling.autoscale`); call it yourself after
    Keras' own `compile` (keras_mp's patches uninstalled).

    Args:
        model: a compiled `keras.Model`.

    Returns:
        Whether the in-backward step was attached.
    """
    optimizer = getattr(model, "optimizer", None)
    if not getattr(optimizer, "update_in_backward", False):
        if "train_step" in model.__dict__ and getattr(
            model.__dict__["train_step"], "_keras_mp_in_backward", False
        ):
            del model.__dict__["train_step"]  # compiled again with another optimizer
        return False
    check(optimizer)
    if type(model).train_step is not keras.Model.train_step:
        raise ValueError(
            f"{_NAME}: {type(model).__name__} has its own train_step, which makes its "
            "gradients itself; the update inside the backward pass needs Keras' own."
        )
    step = functools.partial(train_step, model)
    step._keras_mp_in_backward = True
    object.__setattr__(model, "train_step", step)
    model.train_function = None
    return True


def _clipper(optimizer, stats):
    """A function of (float32 gradient, its first-pass stats) giving it clipped as
    Keras' `_clip_gradients` would; `stats`: every variable's first-pass stats, in the
    optimizer's order (the global norm is their sum, as Keras' `global_norm`)."""
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        return lambda g: optimizer._clip_by_norm(g)
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        use_norm = ops.sqrt(ops.sum(ops.stack([s[0] for s in stats])))
        clip = optimizer.global_clipnorm
        scale = clip * ops.minimum(1.0 / use_norm, 1.0 / clip)
        scale = scale + (use_norm - use_norm)
        return lambda g: g * scale
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        v = optimizer.clipvalue
        return lambda g: ops.clip(g, -v, v)
    return lambda g: g


def _processor(optimizer, finite, clip, raw: bool):
    """A weight's gradient as the ordinary lean step hands it to `lean_rule`: as it came
    with the step's finiteness (`raw`), else float32, NaN where the step is not finite,
    unscaled and clipped (`LeanStep.apply`, Keras' `apply`)."""
    scale = optimizer.loss_scale_factor

    def process(g, values):
        if raw:
            return {"grad": g, "step_finite": values.pop("step_finite")}
        g = ops.where(values.pop("step_finite"), to_float32(g), float("nan"))
        if scale is not None:
            g = g / scale
        return {"grad": clip(g)}

    return process


def train_step(model, state, data):
    """Keras' JAX `train_step` with each large weight updated in the backward pass.

    Args:
        model: the compiled model (`attach` binds it).
        state: `(trainable, non_trainable, optimizer, metrics)` variable values.
        data: a batch `(x, y, sample_weight)`.

    Returns:
        `(logs, state)`, as Keras' `train_step`.
    """
    import jax
    import jax.numpy as jnp

    trainable, non_trainable, opt_values, metrics_values = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    opt = model.optimizer
    variables = list(model.trainable_variables)
    index = [opt._get_variable_index(v) for v in variables]
    big = [opt._slots[i]["group"] is None for i in index]
    scale = opt.loss_scale_factor
    scale = None if scale is None else jnp.asarray(scale, "float32")

    def loss_of(values):
        return model.compute_loss_and_updates(
            values,
            non_trainable,
            metrics_values,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=opt_values,
        )

    # The order in which the backward pass makes the gradients: the reverse of the forward
    # pass's first reads; the updating pass threads one token through them in that order.
    order = first_reads(lambda values: loss_of(values)[0], list(trainable))

    # Pass 1: each gradient reduced to its float32 sum of squares and finiteness as made.
    first_tag = stats_tag()

    def first(stats):
        # not chained: threaded, XLA:GPU makes the gradients of many layers ahead of their
        # turn and holds them (Llama-3-8B: 32.94 GiB chained, 31.14 not; BENCHMARKS 23)
        tagged = [
            first_tag(w, s, scale, jnp.zeros((), "float32"))[0] for w, s in zip(trainable, stats)
        ]
        return loss_of(tagged)[0]

    zeros = [jnp.zeros((2,), "float32") for _ in variables]
    stats = jax.grad(first)(zeros)
    finite = jnp.logical_not(jnp.any(jnp.stack([s[1] for s in stats]) > 0))
    # The second pass must start after the first and share nothing with it: XLA would
    # otherwise merge the two passes' identical matmuls (common subexpressions), making
    # every gradient once for both, held until the step's finiteness is known.
    trainable, finite, stats = jax.lax.optimization_barrier((list(trainable), finite, stats))

    mapping = list(zip(opt.variables, opt_values)) + list(zip(variables, trainable))
    with keras.StatelessScope(state_mapping=mapping):
        lr = ops.cast(opt.learning_rate, "float32")
        clip = _clipper(opt, stats)  # Keras sums the norms in the model's order
        raws = opt._raw_gradients(list(trainable), variables)
        inputs = []  # per large weight: (tag, carriers, scalars, writes, names)
        for v, is_big, raw in zip(variables, big, raws):
            if not is_big:
                inputs.append(None)
                continue
            static, values, writes = opt._inputs(None, v, lr)
            names = tuple(n for n in writes if n != "weight")
            carriers = tuple(to_carrier(values[n]) for n in names)
            dtypes = tuple(values[n].dtype for n in names)
            scalars = {
                k: values[k] for k in ("lr", "iterations", "seed", "weight_decay") if k in values
            }
            scalars["step_finite"] = finite
            process = _processor(opt, finite, clip, raw)
            tag = update_tag(static, opt._hyper(), names, dtypes, process)
            inputs.append((tag, carriers, scalars, writes, names))

    # Pass 2: the large weights' updates in the backward pass; the small ones' gradients.
    big_order = [i for i in order if inputs[i] is not None]

    def second(weights, carriers):
        def tag_of(i):
            return lambda w, token: inputs[i][0](w, carriers[i], inputs[i][2], token)

        tagged, token = chained(weights, big_order, tag_of)
        loss, aux = loss_of(tagged)
        return loss + 0.0 * token, aux

    carriers = [None if inp is None else inp[1] for inp in inputs]
    (_, aux), (news, new_carriers) = jax.value_and_grad(second, argnums=(0, 1), has_aux=True)(
        list(trainable), carriers
    )
    unscaled_loss, y_pred, non_trainable, metrics_values = aux

    with keras.StatelessScope(state_mapping=mapping) as scope:
        small_grads, small_vars = [], []
        for v, inp, new, carried in zip(variables, inputs, news, new_carriers):
            if inp is None:
                g = ops.where(finite, to_float32(new), float("nan"))
                g = clip(g if scale is None else g / scale)
                small_grads.append(g)
                small_vars.append(v)
                continue
            _, _, _, writes, names = inp
            opt.assign(v, new)
            for n, c in zip(names, carried):
                opt.assign(writes[n], from_carrier(c, writes[n].dtype))
        if small_vars:
            from keras_mp.lean import packed_step

            packed_step.packed_update(opt, small_grads, small_vars, lr)
        _after_update(opt, finite)
        trainable = [scope.get_current_value(v) for v in variables]
        opt_values = [scope.get_current_value(v) for v in opt.variables]

    logs, metrics_values = keras_internals.update_metrics_variables(
        model, metrics_values, unscaled_loss, x, y, y_pred, sample_weight
    )
    return logs, (trainable, non_trainable, opt_values, metrics_values)


def _after_update(opt, finite) -> None:
    """What Keras' `apply` and `LeanStep.apply` do after the variables' updates:
    constraints, EMA, `iterations` (+1 for an applied step), `skipped_steps`."""
    for variable in opt._trainable_variables:
        if variable.constraint is not None:
            variable.assign(variable.constraint(variable))
    if opt.use_ema:
        opt._update_model_variables_moving_average(opt._trainable_variables)
        if opt.ema_overwrite_frequency is not None:
            now = ops.equal((opt.iterations + 1) % opt.ema_overwrite_frequency, 0)
            for var, average in zip(opt._trainable_variables, opt._model_variables_moving_average):
                var.assign(ops.where(now, ops.cast(average, var.dtype), var.value))
    skipped = ops.cast(ops.logical_not(finite), "int32")
    opt.skipped_steps.assign_add(skipped)
    opt._iterations.assign_add(ops.cast(1 - skipped, opt._iterations.dtype))
