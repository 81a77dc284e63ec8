"""The lean update of a large matrix in row blocks: no whole-matrix float32 temporaries.

`lean_rule` decodes a variable's weight and moments to float32, updates them and encodes
them back: XLA fuses that, but around the quantized moments' block maxima it writes
float32 values of the whole matrix. For Llama-3-8B's two 525M-parameter vocabulary
matrices that is 8.3 GiB of float32 buffers at the update (BENCHMARKS 18), more than
their state. Here a large matrix is updated `rows` at a time in a loop (`ops.fori_loop`:
one block's float32 values live at once), in two passes:

1. whole-matrix reductions, fused by XLA without a float32 copy: the finiteness test and,
   for a factored second moment (`keras_mp.lean.factored`), the new row and column
   averages of the squared gradient and the mean of the rows (every block's estimate
   needs the column averages, which need every row);
2. for each row block: the weight, the first moment's 4-bit codes and scales (a block
   holds whole rows, and its values whole quantization blocks), the second moment (the
   estimate `r * c / mean(r)` from pass 1, or its own codes) and the gradient, sliced;
   `keras_mp.lean.rule.update` on them, with the stochastic roundings' noise of the
   block's own element indices; the results written back in place.

Each element sees the same arithmetic and the same random bits as in `lean_rule`, and the
reductions are the same ones on the same values: the result is bit-identical
(tests/test_lean_chunked.py, JAX and TensorFlow).

Only a rank-2 variable with more than `chunk_values()` values, one shard (no
distribution) and moments whose blocks fit whole into a row block is chunked; the rest
take `lean_rule` as before. `KERAS_MP_LEAN_CHUNK` sets the values a row block holds at
most (default 2**24, 64 MiB of float32 each); `0` turns chunking off.
"""

from __future__ import annotations

import math
import os

import keras
from keras import ops

from keras_mp.lean import codecs as lean_codecs
from keras_mp.lean import factored

__all__ = [
    "CHUNK_ENV",
    "DEFAULT_CHUNK_VALUES",
    "chunk_rows",
    "chunk_values",
    "chunked_rule",
    "raw_gradient",
]

CHUNK_ENV = "KERAS_MP_LEAN_CHUNK"
DEFAULT_CHUNK_VALUES = 1 << 24


def chunk_values() -> int:
    """The most values a row block holds (`KERAS_MP_LEAN_CHUNK`, default 2**24; 0: off).

    Returns:
        An int (0 when chunking is off).
    """
    raw = os.environ.get(CHUNK_ENV, "").strip()
    if not raw:
        return DEFAULT_CHUNK_VALUES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{CHUNK_ENV}={raw!r}: expected the values a row block holds at most (a "
            "non-negative integer; 0 turns chunked updates off)."
        )
    return value


def _quantized_length(static) -> int:
    """The block length every quantized moment of `static` uses (1 if none)."""
    formats = [f for f in (static.m, static.v) if f in lean_codecs.QUANTIZED]
    return static.blocks.length if formats else 1


def chunk_rows(static, limit: int | None = None) -> int | None:
    """Rows per block of `static`'s chunked update, or None where it is updated whole.

    Args:
        static: the variable's `keras_mp.lean.rule.Static`.
        limit: the most values a block holds (default `chunk_values()`).

    Returns:
        The largest divisor of the rows whose block holds at most `limit` values and
        whole quantization blocks; None for a small, sharded or non-matrix variable.
    """
    limit = chunk_values() if limit is None else limit
    shape = tuple(int(d) for d in static.shape)
    if not limit or len(shape) != 2 or math.prod(shape) <= limit:
        return None
    if keras.distribution.distribution() is not None:
        return None  # a sharded row axis would be gathered for each block
    rows, cols = shape
    length = _quantized_length(static)
    if length > 1:
        blocks = static.blocks
        if any(s != 1 for s in blocks.shards) or blocks.count * blocks.length != rows * cols:
            return None  # padded or shard-major blocks: not whole rows
    for n in range(min(rows - 1, limit // cols), 0, -1):
        if rows % n == 0 and (n * cols) % length == 0:
            return n
    return None


def raw_gradient(variable, limit: int | None = None) -> bool:
    """Whether the optimizer should hand `variable`'s gradient to the update as it comes
    (bfloat16), with the step's finiteness as `step_finite`, rather than as a poisoned
    float32 copy: a rank-2 variable over `chunk_values()` values outside a distribution,
    which `chunk_rows` will most likely cut into row blocks (if it does not, `lean_rule`
    casts and poisons it itself).

    Args:
        variable: a trainable variable.
        limit: the most values a block holds (default `chunk_values()`).

    Returns:
        A bool.
    """
    limit = chunk_values() if limit is None else limit
    shape = tuple(int(d) for d in variable.shape)
    return bool(
        limit
        and len(shape) == 2
        and math.prod(shape) > limit
        and keras.distribution.distribution() is None
    )


def chunked_rule(static, hyper, values: dict, rows: int, update, seed) -> dict:
    """`keras_mp.lean.rule.lean_rule` of a matrix, `rows` rows at a time.

    Args:
        static: the variable's `Static` (rank 2; `chunk_rows` gave `rows`).
        hyper: the optimizer's `Hyper`.
        values: as `lean_rule`'s.
        rows: rows per block.
        update: `keras_mp.lean.rule.update` (passed in: that module dispatches here).
        seed: the step's noise seed of the variable (`keras_mp.lean.rule.noise_seed`).

    Returns:
        The new state, as `lean_rule` returns it (bit-identical).
    """
    shape = tuple(int(d) for d in static.shape)
    total_rows, cols = shape
    # the gradient as given (bfloat16 where the optimizer left it so: `raw_gradient`), cast
    # to float32 block by block inside the loop: a float32 copy made before the loop
    # would be a whole-matrix buffer (the loop's operand)
    g = ops.reshape(values["grad"], shape)
    square = values.get("grad_square")
    if square is not None:
        square = ops.reshape(square, shape)
    finite = ops.all(ops.isfinite(g))
    if "step_finite" in values:  # the whole step's finiteness (`raw_gradient`)
        finite = ops.logical_and(finite, values["step_finite"])
    is_factored = static.v == factored.FORMAT
    state = {}  # the stored arrays the blocks are written into
    for name in ("weight", "compensation", "m", "m_scale", "v", "v_scale"):
        if name in values and not (is_factored and name in ("v", "v_scale")):
            state[name] = values[name]
    whole = {}  # pass 1: the factored averages
    if is_factored:
        sq = ops.square(ops.cast(g, "float32")) if square is None else square
        beta = hyper.beta_2
        new_rows = values["v"] + (ops.mean(sq, axis=1) - values["v"]) * (1.0 - beta)
        new_cols = values["v_scale"] + (ops.mean(sq, axis=0) - values["v_scale"]) * (1.0 - beta)
        r = ops.expand_dims(new_rows, 1)
        whole["total"] = ops.maximum(ops.mean(r, axis=0, keepdims=True), 1e-30)
        whole["r"] = r
        whole["c"] = ops.expand_dims(new_cols, 0)
    length = _quantized_length(static)
    per_block = rows * cols // length if length > 1 else 0
    block_static = static._replace(
        shape=(rows, cols),
        blocks=lean_codecs.Blocks((1, 1), per_block, length) if length > 1 else static.blocks,
    )
    scalars = {k: values[k] for k in ("lr", "iterations", "seed", "weight_decay") if k in values}

    def rows_of(x, start, count):
        return ops.slice(x, (start, 0), (count, x.shape[1]))

    def body(i, carry):
        start = i * rows
        block = dict(scalars)
        for name, x in carry.items():
            if name in ("m", "v") and static.__getattribute__(name) in lean_codecs.QUANTIZED:
                block[name] = rows_of(x, i * per_block, per_block)
            elif name in ("m_scale", "v_scale"):
                block[name] = ops.slice(x, (i * per_block,), (per_block,))
            else:
                block[name] = rows_of(x, start, rows)
        block["grad"] = ops.cast(rows_of(g, start, rows), "float32")
        if square is not None:
            block["grad_square"] = rows_of(square, start, rows)
        if is_factored:
            block["v_estimate"] = (rows_of(whole["r"], start, rows) / whole["total"]) * whole["c"]
        index = ops.arange(rows * cols, dtype="int32") + start * cols
        fields = lean_codecs.uniform_fields(lean_codecs.hash_index(index, seed), 3)
        noise = [ops.reshape(u, (rows, cols)) for u in fields]
        out = update(block_static, hyper, block, noise)
        new = {}
        for name, x in carry.items():
            kept = ops.where(finite, out[name], block[name])
            if name in ("m", "v") and static.__getattribute__(name) in lean_codecs.QUANTIZED:
                new[name] = ops.slice_update(x, (i * per_block, 0), kept)
            elif name in ("m_scale", "v_scale"):
                new[name] = ops.slice_update(x, (i * per_block,), kept)
            else:
                new[name] = ops.slice_update(x, (start, 0), kept)
        return new

    result = ops.fori_loop(0, total_rows // rows, body, state)
    result = dict(result)
    if is_factored:
        result["v"] = ops.where(finite, new_rows, values["v"])
        result["v_scale"] = ops.where(finite, new_cols, values["v_scale"])
    return result
