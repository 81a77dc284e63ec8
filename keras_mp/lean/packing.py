"""Many variables' lean updates as one: their state packed into rows of blocks.

`lean_rule` updates one variable; run once per variable, a model's update is hundreds of
small computations (kernels on a GPU, loops and launches on a CPU), each with its own
hash set-up and reduction, and each read through reshapes between the weight's shape and
its moments' blocks. Here the variables of one *group* (same weight dtype, moment
formats, block length and weight decay) are laid out as the rows of one `(rows, length)`
array: each variable's values in row-major order, cut into its moments' blocks
(`codecs.Blocks`; the last one zero-padded), one variable after the other. Weights,
gradients, compensations and moments all share that layout, so the whole group's update
is one elementwise pass and one reduction per moment, with no reshape inside it.

The result is bit for bit `lean_rule`'s for every variable: the same arithmetic on the
same values, the stochastic roundings' noise hashed from the same (step, variable,
element) index, and a variable whose gradient holds an inf or NaN kept as it was while
the others of its group are updated.

`LeanOptimizer` runs all groups behind one test: when every gradient of the step is finite
(the usual case) the groups' updates carry no per-variable select at all; otherwise each
variable whose gradient holds an inf or NaN keeps its state, as under `lean_rule`.

A variable whose state is split across devices (a `keras.distribution` layout: blocks of
several shards) or stored in a format this layout does not know keeps `lean_rule`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from keras import ops

from keras_mp.lean import codecs as lean_codecs
from keras_mp.lean.rule import Hyper, Static, noise_seed, update

__all__ = ["Group", "all_finite", "groups", "packable", "packed_rule", "stack", "unstack"]

_FORMATS = (None, *lean_codecs.MOMENT_FORMATS)  # moment formats laid out as rows here


class Group(NamedTuple):
    """Variables updated together: their `Static`s (one weight dtype, moment formats,
    block length and weight decay) and their indices in the list given to `groups`."""

    statics: tuple
    indices: tuple


def packable(static: Static) -> bool:
    """Whether a variable's update can run packed: its state is on one shard (and its
    moments in one of `codecs.MOMENT_FORMATS`)."""
    return (
        all(n == 1 for n in static.blocks.shards) and static.m in _FORMATS and static.v in _FORMATS
    )


def groups(statics, decays, largest: int | None = None, squares=None) -> list:
    """The variables grouped for `packed_rule`, in their first member's order.

    Args:
        statics: each variable's `Static` (all `packable`).
        decays: whether each variable has weight decay.
        largest: variables with at least this many values each form a group of their
            own (None: no limit).
        squares: whether each variable's gradient comes with its own square (a sparse
            gradient, `rule.dense_gradient`; default: none). They are grouped apart, so
            that a group of dense gradients never carries squares.

    Returns:
        A list of `Group`.
    """
    found: dict = {}
    out = []
    squares = squares if squares is not None else [False] * len(statics)
    for i, (static, decay, square) in enumerate(zip(statics, decays, squares)):
        alone = largest is not None and math.prod(static.shape) >= largest
        key = (
            ("alone", i)
            if alone
            else (
                static.weight_dtype,
                static.m,
                static.v,
                static.blocks.length,
                bool(decay),
                bool(square),
            )
        )
        if key not in found:
            found[key] = len(out)
            out.append(([], []))
        out[found[key]][0].append(static)
        out[found[key]][1].append(i)
    return [Group(tuple(s), tuple(i)) for s, i in out]


def _rows(x, static: Static):
    """A weight-shaped tensor as its `(blocks, length)` rows (zero padded)."""
    blocks = static.blocks
    size = math.prod(static.shape)
    x = ops.reshape(x, (size,))
    pad = blocks.count * blocks.length - size
    if pad:
        x = ops.pad(x, [(0, pad)])
    return ops.reshape(x, (blocks.count, blocks.length))


def _unrows(x, static: Static):
    """Inverse of `_rows`."""
    size = math.prod(static.shape)
    x = ops.reshape(x, (-1,))
    if x.shape[0] != size:
        x = x[:size]
    return ops.reshape(x, static.shape)


def _concat(parts: list):
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=0)


def _split(x, counts: list) -> list:
    if len(counts) == 1:
        return [x]
    out, start = [], 0
    for n in counts:
        out.append(x[start : start + n])
        start += n
    return out


def _noise(iterations, seeds, counts: list, length: int) -> list:
    """`codecs.uniforms`' three noise fields of every row's values: the hash of (step,
    variable, element index within the variable) that `lean_rule` uses."""
    local = np.concatenate([np.arange(n, dtype="int32") for n in counts]) * length
    index = ops.expand_dims(ops.convert_to_tensor(local, "int32"), 1) + ops.expand_dims(
        ops.arange(length, dtype="int32"), 0
    )
    seed_rows = _concat(
        [ops.broadcast_to(ops.reshape(s, (1,)), (n,)) for s, n in zip(seeds, counts)]
    )
    seed = ops.expand_dims(ops.cast(noise_seed(iterations, seed_rows), "int32"), 1)
    return lean_codecs.uniform_fields(lean_codecs.hash_index(index, seed), 3)


def stack(statics: tuple, values: list) -> dict:
    """The stored state of variables kept each in its own arrays, laid out as one group's
    rows (the state `packed_rule` takes): `compensation`, `m`, `m_scale`, `v`, `v_scale`
    where the variables have them.

    Args:
        statics: the group's `Static`s (`groups`).
        values: each variable's `lean_rule` inputs.

    Returns:
        A dict of `(rows, ...)` arrays.
    """
    first = statics[0]
    state = {}
    if "compensation" in values[0]:
        state["compensation"] = _concat(
            [_rows(v["compensation"], st) for st, v in zip(statics, values)]
        )
    for name in ("m", "v"):
        fmt = getattr(first, name)
        if fmt is None:
            continue
        if fmt in lean_codecs.QUANTIZED:  # already codes of blocks, a scale per block
            state[name] = _concat([v[name] for v in values])
            state[name + "_scale"] = _concat([v[name + "_scale"] for v in values])
        else:
            state[name] = _concat([_rows(v[name], st) for st, v in zip(statics, values)])
    return state


def unstack(state: dict, statics: tuple) -> list:
    """Inverse of `stack`: each variable's own stored state."""
    counts = [st.blocks.count for st in statics]
    out = [{} for _ in statics]
    for name, x in state.items():
        for o, st, part in zip(out, statics, _split(x, counts)):
            codes = name in ("m", "v") and getattr(st, name) in lean_codecs.QUANTIZED
            rows = codes or name.endswith("_scale")
            o[name] = part if rows else _unrows(part, st)
    return out


def packed_rule(
    statics: tuple,
    hyper: Hyper,
    values: list,
    state: dict | None = None,
    guard: bool = True,
    skip=None,
) -> tuple:
    """The lean updates of one group's variables, run as one.

    Args:
        statics: the group's `Static`s (`groups`).
        hyper: the optimizer's constants.
        values: each variable's `lean_rule` inputs (`lr`, `iterations` and
            `weight_decay` are read from the first); its stored state (`compensation`,
            moments) is read from `state` instead when that is given.
        state: the group's stored state as rows (`stack`; a `LeanOptimizer` with
            `pack_small` keeps it so), or None to `stack` it from `values`. Its
            `compensation` may instead be the members' values one after the other (1-D,
            no padding: weight-shaped state is not padded to blocks); it is returned so.
        guard: keep the state of a variable whose gradient holds an inf or NaN (False:
            the caller knows that every gradient is finite, and the selects are left out).
        skip: for each variable, whether to keep its state and weight as they are (a
            variable without a gradient this step; default: none).

    Returns:
        `(weights, state)`: each variable's new weight, in order, and the group's new
        stored state as rows.
    """
    first = statics[0]
    length = first.blocks.length
    counts = [st.blocks.count for st in statics]
    rows = sum(counts)
    shape = (rows, length)
    layout = lean_codecs.Blocks((1, 1), rows, length)
    grads = [_rows(ops.cast(v["grad"], "float32"), st) for st, v in zip(statics, values)]
    packed = {
        "grad": _concat(grads),
        "lr": values[0]["lr"],
        "iterations": values[0]["iterations"],
    }
    if any("grad_square" in v for v in values):  # a sparse gradient: Keras' square
        squares = [
            ops.cast(v["grad_square"], "float32") if "grad_square" in v else ops.square(g)
            for v, g in zip(values, [ops.cast(v["grad"], "float32") for v in values])
        ]  # (`groups` keeps dense gradients apart when it can)
        packed["grad_square"] = _concat([_rows(q, st) for q, st in zip(squares, statics)])
    if "weight_decay" in values[0]:
        packed["weight_decay"] = values[0]["weight_decay"]
    packed["weight"] = _concat([_rows(v["weight"], st) for st, v in zip(statics, values)])
    stored = dict(stack(statics, values) if state is None else state)
    flat = "compensation" in stored and len(stored["compensation"].shape) == 1
    if flat:
        stored["compensation"] = _flat_rows(stored["compensation"], statics)
    packed.update(stored)
    noise = _noise(values[0]["iterations"], [v["seed"] for v in values], counts, length)
    static = Static(shape, first.weight_dtype, first.m, first.v, layout)
    new = update(static, hyper, packed, noise)
    keep_rows = None
    if guard:
        # each variable's own non-finite guard: a row is kept when its variable's
        # gradient holds an inf or NaN anywhere
        bad_rows = ops.any(ops.logical_not(ops.isfinite(packed["grad"])), axis=1)
        if len(counts) == 1:
            keep = ops.any(bad_rows)
            keep_rows = ops.broadcast_to(keep, (rows,))
        else:
            # bad rows per variable: differences of a running count at its first and
            # last row
            running = ops.cumsum(ops.cast(bad_rows, "int32"))
            running = ops.concatenate([ops.zeros((1,), "int32"), running])
            ends = np.cumsum(counts).astype("int32")
            bad = ops.take(running, ends) - ops.take(running, ends - np.asarray(counts, "int32"))
            member = np.repeat(np.arange(len(counts), dtype="int32"), counts)
            keep_rows = ops.take(bad > 0, ops.convert_to_tensor(member))
    if skip is not None and any(skip):
        fixed = ops.convert_to_tensor(np.repeat(np.asarray(skip, bool), counts))
        keep_rows = fixed if keep_rows is None else ops.logical_or(keep_rows, fixed)
    if keep_rows is not None:
        for name, x in new.items():
            rows_kept = keep_rows if name.endswith("_scale") else ops.expand_dims(keep_rows, 1)
            new[name] = ops.where(rows_kept, packed[name], x)
    weight = new.pop("weight")
    weights = [_unrows(part, st) for part, st in zip(_split(weight, counts), statics)]
    if flat:
        parts = _split(new["compensation"], counts)
        new["compensation"] = _concat(
            [ops.reshape(_unrows(part, st), (-1,)) for part, st in zip(parts, statics)]
        )
    return weights, new


def _flat_rows(values, statics: tuple):
    """The members' weight-shaped values, one after the other in `values` (1-D), as the
    group's rows."""
    out, start = [], 0
    for st in statics:
        size = math.prod(st.shape)
        out.append(_rows(values[start : start + size], st))
        start += size
    return _concat(out)


def all_finite(grads) -> object:
    """Whether every gradient in `grads` is finite everywhere (a scalar boolean tensor)."""
    flags = [ops.all(ops.isfinite(ops.cast(g, "float32"))) for g in grads]
    out = flags[0]
    for f in flags[1:]:
        out = ops.logical_and(out, f)
    return out
