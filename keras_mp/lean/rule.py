"""The lean update as one pure function: stored state and gradient in, new state out.

`lean_rule` is what `LeanOptimizer` compiles for each variable (Adam/AdamW/SGD); `read`,
`constant` and `to_float32` are the small conversions both of the lean paths share.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
from keras import ops

from keras_mp.lean import chunked, factored
from keras_mp.lean import codecs as lean_codecs
from keras_mp.scaling.grad_finite import is_sparse

__all__ = [
    "Hyper",
    "Static",
    "constant",
    "dense_gradient",
    "is_sparse",
    "lean_rule",
    "noise_seed",
    "read",
    "to_float32",
    "update",
    "variable_seed",
]


class Static(NamedTuple):
    """What a variable's update is specialised on (its compiled kernel's cache key)."""

    shape: tuple
    weight_dtype: str
    m: str | None  # moment formats, None: no such moment
    v: str | None  # `"factored"`: `v`/`v_scale` hold the row/column averages (`lean.factored`)
    blocks: lean_codecs.Blocks  # the 8-bit moments' blocks (`lean_sharding.blocks`)


class Hyper(NamedTuple):
    kind: str
    rounding: str
    beta_1: float
    beta_2: float
    epsilon: float
    momentum: float
    nesterov: bool


def lean_rule(static: Static, hyper: Hyper, values: dict) -> dict:
    """One variable's lean update: a pure function of its stored state and gradient.

    Decodes the weight (bfloat16 plus compensation, or float32) and the moments to
    float32, applies Adam/AdamW (Keras' formula, decoupled weight decay) or SGD with
    momentum/nesterov in float32, and encodes the results back, the stochastic roundings
    driven by one hash of (step, variable, element).

    Args:
        static: shapes and formats (`Static`).
        hyper: the optimizer's constants (`Hyper`).
        values: `weight`, `grad`, `lr`, `iterations` (int32, before this step), `seed`
            (int32, the variable's), and as stored: `compensation`, `m`, `m_scale`, `v`,
            `v_scale`, `weight_decay` where they apply.

    Returns:
        A dict with the new `weight` and, where given, `compensation`, `m`, `m_scale`,
        `v`, `v_scale`; all as given when the gradient has an inf or NaN.
    """
    rows = chunked.chunk_rows(static)
    if rows is not None:  # a large matrix: in row blocks, no whole float32 temporaries
        seed = noise_seed(values["iterations"], values["seed"])
        return chunked.chunked_rule(static, hyper, values, rows, update, seed)
    g = ops.reshape(ops.cast(values["grad"], "float32"), static.shape)
    if "step_finite" in values:  # a raw gradient (`chunked.raw_gradient`) not chunked
        g = ops.where(values["step_finite"], g, float("nan"))
        values = {k: x for k, x in values.items() if k != "step_finite"}
    if "grad_square" in values:
        values = {**values, "grad_square": ops.reshape(values["grad_square"], static.shape)}
    noise = lean_codecs.uniforms(static.shape, noise_seed(values["iterations"], values["seed"]), 3)
    out = update(static, hyper, {**values, "grad": g}, noise)
    # A non-finite gradient (a NaN batch, an overflow) changes neither the weight nor its
    # state: the stored values are kept as they are (a select, fused into the update).
    finite = ops.all(ops.isfinite(g))
    return {k: ops.where(finite, x, values[k]) for k, x in out.items()}


def update(static: Static, hyper: Hyper, values: dict, noise) -> dict:
    """`lean_rule`'s arithmetic on given noise, before the non-finite guard.

    Args:
        static: shapes and formats (`Static`); `static.shape` is the shape of the
            weight-shaped values (the weight, its gradient and compensation, float moments).
        hyper: the optimizer's constants (`Hyper`).
        values: as `lean_rule`'s, with `grad` already float32 of `static.shape`; `seed`
            is not read; `v_estimate` (a row block's factored second moment, from
            `keras_mp.lean.chunked`) replaces the factored update of `v`.
        noise: three uniform [0, 1) tensors of `static.shape`: the stochastic roundings'
            noise of the weight, the first and the second moment.

    Returns:
        A dict with the new `weight` and, where given, `compensation`, `m`, `m_scale`,
        `v`, `v_scale`, whatever the gradient holds.
    """
    shape = static.shape
    g = values["grad"]
    lr = values["lr"]
    comp = values.get("compensation")
    w = lean_codecs.decode_weight(values["weight"], comp, hyper.rounding)
    step = ops.cast(values["iterations"] + 1, "float32")
    noise_w, noise_m, noise_v = noise

    def moment(name, signed):
        return lean_codecs.decode_moment(
            values[name],
            values.get(name + "_scale"),
            getattr(static, name),
            signed,
            shape,
            static.blocks,
        )

    out = {}

    def store(name, x, signed, noise):
        codes, scale = lean_codecs.encode_moment(
            x, getattr(static, name), signed, noise, static.blocks
        )
        out[name] = codes
        if scale is not None:
            out[name + "_scale"] = scale

    update = ops.zeros_like(w)
    if "weight_decay" in values:
        update = update - w * (values["weight_decay"] * lr)
    if hyper.kind in ("adam", "adamw"):
        m = moment("m", True)
        m = m + (g - m) * (1.0 - hyper.beta_1)
        square = values.get("grad_square", ops.square(g))
        if "v_estimate" in values:  # a row block of `lean.chunked`: averages made whole
            v = values["v_estimate"]
        elif static.v == factored.FORMAT:  # row and column averages (`lean.factored`)
            v, out["v"], out["v_scale"] = factored.second_moment(
                values["v"], values["v_scale"], square, hyper.beta_2
            )
        else:
            v = moment("v", False)
            v = v + (square - v) * (1.0 - hyper.beta_2)
        alpha = (
            lr
            * ops.sqrt(1.0 - ops.power(hyper.beta_2, step))
            / (1.0 - ops.power(hyper.beta_1, step))
        )
        update = update - alpha * m / (ops.sqrt(v) + hyper.epsilon)
        store("m", m, True, noise_m)
        if static.v != factored.FORMAT:
            store("v", v, False, noise_v)
    elif static.m is not None:
        m = hyper.momentum * moment("m", True) - lr * g
        update = update + (hyper.momentum * m - lr * g if hyper.nesterov else m)
        store("m", m, True, noise_m)
    else:
        update = update - lr * g
    target = w + update
    if static.weight_dtype == "bfloat16":
        out["weight"], compensation = lean_codecs.encode_weight(target, hyper.rounding, noise_w)
        if comp is not None:
            out["compensation"] = compensation
    else:
        out["weight"] = ops.cast(target, static.weight_dtype)
    return out


def read(variable):
    """A variable's value as a tensor: a Keras variable's (mapped in a stateless scope) or
    a backend variable's, as TensorFlow's distributed update passes it.

    Always a tensor, never the variable itself: under a `tf.distribute` strategy a Keras
    variable's `.value` is a `MirroredVariable`, and a compiled `tf.function` called with
    one captures it by its shape and dtype, so every later variable of the same shape and
    dtype would be read from the first one's storage. Read here, inside the strategy's
    update context, it is this replica's copy."""
    if isinstance(variable, keras.Variable):
        variable = variable.value
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(variable)  # a read; Keras' passes variables through
    return ops.convert_to_tensor(variable)


def constant(value):
    """An initializer giving `value` (None: zeros)."""
    if value is None:
        return "zeros"
    return lambda shape, dtype=None: ops.cast(value, dtype)


def dense_gradient(g) -> tuple:
    """`(gradient, square)`: a sparse gradient (TensorFlow's `IndexedSlices`, one row per
    lookup of an embedding) made dense, with the square Keras' Adam uses for it.

    Keras' `ops.square` squares a sparse gradient's rows before they are summed, so on
    TensorFlow Keras' Adam averages the sum of each lookup's squared gradient into its
    second moment, not the square of the summed gradient (JAX's gradients are dense: no
    difference there). `square` is that sum (None for a dense gradient), so the lean update
    follows the rule of the optimizer it replaces on each backend."""
    if not is_sparse(g):
        return g, None
    import tensorflow as tf  # only TensorFlow makes IndexedSlices

    square = tf.IndexedSlices(tf.square(g.values), g.indices, g.dense_shape)
    return tf.convert_to_tensor(g), tf.convert_to_tensor(square)


def noise_seed(iterations, seed):
    """The hash seed of a step's stochastic roundings for one variable (or one of its
    slots): `iterations` (int32, before the step) and the variable's own `seed` in one
    int32, as every lean path derives it."""
    return iterations * 1000003 + seed


def variable_seed(index: int) -> int:
    """A variable's own noise seed (`noise_seed`'s `seed`): its index among the
    optimizer's variables times a prime, the same on every backend and replica."""
    return index * 7919


def to_float32(g):
    if is_sparse(g):
        return type(g)(ops.cast(g.values, "float32"), g.indices, g.dense_shape)
    return ops.cast(g, "float32")
