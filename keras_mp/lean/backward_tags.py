"""The custom-VJP tags that carry a weight's work into the backward pass (JAX).

Pieces of `keras_mp.lean.in_backward`'s train step: `stats_tag` (a weight's gradient reduced
to its norm and finiteness as it is made), `update_tag` (a weight's lean update run in the
backward pass, its new value and state returned as cotangents), `chained` (one token
threaded through tags, so XLA runs their backward work one after another) and
`first_reads` (the order in which a forward pass first reads its weights).
"""

from __future__ import annotations

import functools

import numpy as np

from keras_mp.lean.rule import lean_rule

__all__ = ["chained", "first_reads", "from_carrier", "stats_tag", "to_carrier", "update_tag"]

_CARRIER = "float8_e4m3fn"  # integer state's bits travel as a float of the same width


def _float0_or_zeros(x):
    import jax

    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return jax.numpy.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def to_carrier(x):
    import jax

    if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
        return x
    return jax.lax.bitcast_convert_type(x, _CARRIER)


def from_carrier(x, dtype):
    import jax

    if x.dtype == dtype:
        return x
    return jax.lax.bitcast_convert_type(x, dtype)


@functools.cache
def stats_tag():
    """`tag(w, s, scale, token) = (w, token)`; the backward pass gives `s` the gradient's
    `[sum of squares in float32, 1.0 if not finite]`, `w` no gradient (the first pass
    asks for none) and `token` its cotangent once the stats are made (`chained`)."""
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


def update_tag(static, hyper, names: tuple, dtypes: tuple, process):
    """`tag(w, carriers, scalars, token) = (w, token)`; the backward pass runs the
    weight's update and gives `w` and `carriers` the new weight and state (`carriers` in
    `names`' order, stored as `dtypes`), `scalars` zeros and `token` its cotangent once
    the update is made (`chained`)."""
    import jax

    @jax.custom_vjp
    def tag(w, carriers, scalars, token):
        return w, token

    def fwd(w, carriers, scalars, token):
        return (w, token), (w, carriers, scalars)

    def bwd(res, cotangents):
        (g, token), (w, carriers, scalars) = jax.lax.optimization_barrier((cotangents, res))
        values = dict(scalars)
        values.update({n: from_carrier(c, d) for n, c, d in zip(names, carriers, dtypes)}, weight=w)
        values.update(process(g, values))
        new = lean_rule(static, hyper, values)
        out = tuple(to_carrier(new[n]) for n in names)
        weight, out, token = jax.lax.optimization_barrier((new["weight"], out, token))
        return weight, out, jax.tree.map(_float0_or_zeros, scalars), token

    tag.defvjp(fwd, bwd)
    return tag


def chained(weights, order, tag_of):
    """`(tagged weights, token)`: each weight `i` in `order` through `tag_of(i)(w, token)`,
    one float32 token threaded through them all in that order.

    In the backward pass the token comes back through the tags in the reverse order, each
    tag's work (its weight's update, or its gradient's stats) behind the previous one's:
    XLA may then neither merge the work of many weights into one kernel (GPU horizontal
    fusion: alike updates of every layer would wait for the last of their gradients) nor
    put one off to the end of the step, holding its gradient. `order` is the order in
    which the forward pass first reads the weights (`first_reads`), so each gradient's
    work waits only for the gradients made before it."""
    import jax.numpy as jnp

    tagged = list(weights)
    token = jnp.zeros((), "float32")
    for i in order:
        tagged[i], token = tag_of(i)(weights[i], token)
    return tagged, token


def first_reads(loss, weights) -> list:
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
