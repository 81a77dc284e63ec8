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
import numpy as np
from keras import ops

from keras_mp.keras_glue import keras_internals
from keras_mp.lean.rule import lean_rule, to_float32

__all__ = ["attach", "check", "train_step"]

_NAME = "LeanOptimizer(update_in_backward=True)"
_CARRIER = "float8_e4m3fn"  # integer state's bits travel as a float of the same width


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


def _float0_or_zeros(x):
    import jax

    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return jax.numpy.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def _to_carrier(x):
    import jax

    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return x
    return jax.lax.bitcast_convert_type(x, _CARRIER)


def _from_carrier(x, dtype):
    import jax

    if x.dtype == dtype:
        return x
    return jax.lax.bitcast_convert_type(x, dtype)


@functools.cache
def _stats_tag():
    """`tag(w, s, scale, token) = (w, token)`; the backward pass gives `s` the gradient's
    `[sum of squares in float32, 1.0 if not finite]`, `w` no gradient (the first pass
    asks for none) and `token` its cotangent once the stats are made (`_chained`)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def tag(w, s, scale, token):
        return w, token

    def fwd(w, s, scale, token):
        return (w, token), (w, scale)

    def bwd(res, cotangents):
        (g, token), (w, scale) = jax.lax.optimization_barrier((cotangents, res))
        g32 = g.astype("float32")
        if scale is not None:
            g32 = g32 / scale
        stats = jnp.stack(
            [jnp.sum(jnp.square(g32)), 1.0 - jnp.all(jnp.isfinite(g32)).astype("float32")]
        )
        stats, token = jax.lax.optimization_barrier((stats, token))
        zero_scale = None if scale is None else jnp.zeros_like(scale)
        return jnp.zeros_like(w), stats, zero_scale, token

    tag.defvjp(fwd, bwd)
    return tag


def _update_tag(static, hyper, names: tuple, dtypes: tuple, process):
    """`tag(w, carriers, scalars, token) = (w, token)`; the backward pass runs the
    weight's update and gives `w` and `carriers` the new weight and state (`carriers` in
    `names`' order, stored as `dtypes`), `scalars` zeros and `token` its cotangent once
    the update is made (`_chained`)."""
    import jax

    @jax.custom_vjp
    def tag(w, carriers, scalars, token):
        return w, token

    def fwd(w, carriers, scalars, token):
        return (w, token), (w, carriers, scalars)

    def bwd(res, cotangents):
        (g, token), (w, carriers, scalars) = jax.lax.optimization_barrier((cotangents, res))
        values = dict(scalars)
        values.update(
            {n: _from_carrier(c, d) for n, c, d in zip(names, carriers, dtypes)}, weight=w
        )
        values.update(process(g, values))
        new = lean_rule(static, hyper, values)
        out = tuple(_to_carrier(new[n]) for n in names)
        weight, out, token = jax.lax.optimization_barrier((new["weight"], out, token))
        return weight, out, jax.tree.map(_float0_or_zeros, scalars), token

    tag.defvjp(fwd, bwd)
    return tag


def _chained(weights, order, tag_of):
    """`(tagged weights, token)`: each weight `i` in `order` through `tag_of(i)(w, token)`,
    one float32 token threaded through them all in that order.

    In the backward pass the token comes back through the tags in the reverse order, each
    tag's work (its weight's update, or its gradient's stats) behind the previous one's:
    XLA may then neither merge the work of many weights into one kernel (GPU horizontal
    fusion: alike updates of every layer would wait for the last of their gradients) nor
    put one off to the end of the step, holding its gradient. `order` is the order in
    which the forward pass first reads the weights (`_first_reads`), so each gradient's
    work waits only for the gradients made before it."""
    import jax.numpy as jnp

    tagged = list(weights)
    token = jnp.zeros((), "float32")
    for i in order:
        tagged[i], token = tag_of(i)(weights[i], token)
    return tagged, token


def _first_reads(loss, weights) -> list:
    """The indices of `weights` in the order `loss(weights)`'s forward pass first reads
    them (from its jaxpr, nested calls followed); weights it never reads come last."""
    import jax

    specs = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights]
    closed = jax.make_jaxpr(loss)(specs)
    first: dict = {}
    clock = [0]

    def walk(jaxpr, names: dict):
        for eqn in jaxpr.eqns:
            clock[0] += 1
            inner = [
                p.jaxpr if hasattr(p, "jaxpr") and hasattr(p, "consts") else p
                for p in eqn.params.values()
            ]
            inner = [j for j in inner if hasattr(j, "eqns") and len(j.invars) == len(eqn.invars)]
            for k, var in enumerate(eqn.invars):
                index = names.get(var) if hasattr(var, "aval") and not hasattr(var, "val") else None
                if index is None:
                    continue
                if inner:  # a nested call: the weight's first read inside it
                    walk(inner[0], {inner[0].invars[k]: index})
                first.setdefault(index, clock[0])

    walk(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars)})
    return sorted(range(len(weights)), key=lambda i: (first.get(i, float("inf")), i))


def _stats_call(tag, s, scale, w, token):
    return tag(w, s, scale, token)


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
    # pass's first reads. Each pass threads one token through the weights in that order.
    order = _first_reads(lambda values: loss_of(values)[0], list(trainable))

    # Pass 1: each gradient reduced to its float32 sum of squares and finiteness as made.
    stats_tag = _stats_tag()

    def first(stats):
        # not chained: threaded, XLA:GPU makes the gradients of many layers ahead of their
        # turn and holds them (Llama-3-8B: 32.94 GiB chained, 31.14 not; BENCHMARKS 23)
        tagged = [
            _stats_call(stats_tag, s, scale, w, jnp.zeros((), "float32"))[0]
            for w, s in zip(trainable, stats)
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
            carriers = tuple(_to_carrier(values[n]) for n in names)
            dtypes = tuple(values[n].dtype for n in names)
            scalars = {
                k: values[k] for k in ("lr", "iterations", "seed", "weight_decay") if k in values
            }
            scalars["step_finite"] = finite
            process = _processor(opt, finite, clip, raw)
            tag = _update_tag(static, opt._hyper(), names, dtypes, process)
            inputs.append((tag, carriers, scalars, writes, names))

    # Pass 2: the large weights' updates in the backward pass; the small ones' gradients.
    big_order = [i for i in order if inputs[i] is not None]

    def second(weights, carriers):
        def tag_of(i):
            return lambda w, token: inputs[i][0](w, carriers[i], inputs[i][2], token)

        tagged, token = _chained(weights, big_order, tag_of)
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
                opt.assign(writes[n], _from_carrier(c, writes[n].dtype))
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
