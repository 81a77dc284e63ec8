"""A factored second moment for the lean state (`LeanOptimizer(moments="int4_factored")`).

Adafactor's estimate (Shazeer & Stern, ICML 2018) of Adam's second moment: for a matrix
gradient `G` (rows x columns) only two float32 vectors persist, exponential averages of
the row means and the column means of `G**2`,

    r = beta_2 * r + (1 - beta_2) * mean(G**2, axis=-1)      # one value a row
    c = beta_2 * c + (1 - beta_2) * mean(G**2, axis=-2)      # one value a column
    v = r[:, None] * c[None, :] / mean(r)                    # the rank-1 estimate

which is exact where `G**2` is itself rank 1, and costs `4 * (rows + columns)` bytes instead
of half a byte a value (4-bit codes). A tensor of rank above 2 is factored over its two
largest dimensions, the others kept (as optax's and T5X's Adafactor do; Keras' and the
paper's take the last two, which for a multi-head attention kernel such as keras_hub's
`(hidden, heads, head_dim)` query kernel keeps `hidden * (heads + head_dim)` values: 1.06
bytes a parameter, more than 4-bit codes). The update stays Adam's
(`keras_mp.lean.rule.update`): the first moment in 4-bit codes as with `moments="int4"`,
`m / (sqrt(v) + epsilon)` with Adam's bias correction (both averages start at zero, so `v`
carries the same `1 - beta_2**t` factor as Adam's), decoupled weight decay unchanged.

Only variables of rank >= 2 with at least `MIN_SIZE` values (65536: the size below which
`pack_small` packs a variable's state with others') are factored; vectors and smaller
tensors keep 4-bit second moments, in their packed groups as before. With Adam's two moments
the state of a factored matrix is then about 2 (bfloat16 weight) + 0.53 (4-bit first moment
and its scales) bytes a parameter.
"""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_mp.lean import codecs as lean_codecs

__all__ = [
    "FORMAT",
    "MIN_SIZE",
    "MOMENTS",
    "MOMENT_CHOICES",
    "accumulator_layouts",
    "add_accumulators",
    "accumulator_shapes",
    "factored_axes",
    "first_format",
    "is_factored",
    "second_format",
    "second_moment",
]

FORMAT = "factored"  # the second moment's format (`Static.v`) for a factored variable
MOMENTS = "int4_factored"  # the `moments=` value: first moment 4-bit, second factored
MOMENT_CHOICES = lean_codecs.MOMENT_FORMATS + (MOMENTS,)  # every valid `moments=`
MIN_SIZE = 65536  # `keras_mp.lean.packed_step.SMALL` (not imported: rule.py imports this)
_FIRST = {MOMENTS: "int4"}  # the first moment's (and unfactored tensors') format


def first_format(moments: str) -> str:
    """The storage of the first moment (and of every unfactored slot) under `moments`.

    Args:
        moments: a `LeanOptimizer`'s `moments` argument.

    Returns:
        `"int4"` for `"int4_factored"`, else `moments` itself.
    """
    return _FIRST.get(moments, moments)


def is_factored(shape) -> bool:
    """Whether a variable of `shape` gets a factored second moment: rank >= 2 and at least
    `MIN_SIZE` values.

    Args:
        shape: the variable's shape.

    Returns:
        A bool.
    """
    shape = tuple(int(d) for d in shape)
    return len(shape) >= 2 and math.prod(shape) >= MIN_SIZE


def second_format(moments: str, shape, unfactored: str) -> str:
    """The second moment's format of a variable of `shape` under `moments`.

    Args:
        moments: the `LeanOptimizer`'s `moments` argument.
        shape: the variable's shape.
        unfactored: its format where it is not factored (`first_format`, or float32 below
            `min_quantized_size`).

    Returns:
        `FORMAT` (`"factored"`) or `unfactored`.
    """
    return FORMAT if moments == MOMENTS and is_factored(shape) else unfactored


def factored_axes(shape) -> tuple:
    """`(a, b)`, `a < b`: the two dimensions a second moment of `shape` is factored over,
    its two largest (the earlier of equal ones); a matrix's `(0, 1)`.

    Args:
        shape: the variable's shape (rank >= 2).

    Returns:
        A tuple of two ints.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"A factored second moment needs a rank >= 2 shape; got {shape}.")
    largest = sorted(range(len(shape)), key=lambda i: (-shape[i], i))[:2]
    return min(largest), max(largest)


def accumulator_shapes(shape) -> tuple:
    """`(row_shape, col_shape)` of a factored second moment: `shape` without the second of
    `factored_axes(shape)` (the rows' averages), and without the first (the columns').

    Args:
        shape: the variable's shape (rank >= 2).

    Returns:
        A tuple of two shapes.
    """
    shape = tuple(int(d) for d in shape)
    a, b = factored_axes(shape)
    return shape[:b] + shape[b + 1 :], shape[:a] + shape[a + 1 :]


def accumulator_layouts(place) -> tuple:
    """`(row_layout, col_layout)`: replicated on the distribution's mesh (each is a few
    kilobytes; XLA's partitioner reduces a sharded gradient's squares into them), None
    without a distribution.

    An explicit replicated layout, not None: under `ModelParallel` Keras would otherwise
    look the variable's path up in the layout map, where a kernel's pattern could match it.

    Args:
        place: the weight's `keras_mp.lean.sharding.Placement`.

    Returns:
        A tuple of two layouts (or Nones).
    """
    if place.mesh is None:
        return None, None
    rank = len(place.axes)
    rows = keras.distribution.TensorLayout((None,) * (rank - 1), place.mesh)
    cols = keras.distribution.TensorLayout((None,) * (rank - 1), place.mesh)
    return rows, cols


def second_moment(rows, cols, square, beta_2: float) -> tuple:
    """One step of the factored second moment.

    Args:
        rows: float32, the row accumulator (`accumulator_shapes(shape)[0]`; for a
            matrix, one value a row).
        cols: float32, the column accumulator (`accumulator_shapes(shape)[1]`).
        square: float32 of the variable's shape: the squared gradient (or, for a sparse
            TensorFlow gradient, the sum of its rows' squares, as Keras' Adam takes it).
        beta_2: the decay of the averages.

    Returns:
        `(v, rows, cols)`: the estimate of the second moment (the variable's shape) and the
        new accumulators.
    """
    a, b = factored_axes(square.shape)
    rows = rows + (ops.mean(square, axis=b) - rows) * (1.0 - beta_2)
    cols = cols + (ops.mean(square, axis=a) - cols) * (1.0 - beta_2)
    r = ops.expand_dims(rows, b)
    # mean(rows) is zero only where every row is (no gradient yet): v is zero there too
    total = ops.maximum(ops.mean(r, axis=a, keepdims=True), 1e-30)
    v = (r / total) * ops.expand_dims(cols, a)
    return v, rows, cols


def add_accumulators(opt, variable, name: str, place) -> tuple:
    """The two accumulator variables of `variable`'s factored moment `name` in `opt`
    (a `LeanOptimizer`), named after the variable as its other state is.

    Returns:
        `(FORMAT, rows, cols)`, as `LeanOptimizer._add_moment` returns a moment's
        `(format, codes, scales)`.
    """
    row_shape, col_shape = accumulator_shapes(variable.shape)
    row_layout, col_layout = accumulator_layouts(place)
    prefix = variable.path.replace("/", "_")
    rows = opt.add_variable(
        row_shape, dtype="float32", name=f"{prefix}_{name}_rows", layout=row_layout
    )
    cols = opt.add_variable(
        col_shape, dtype="float32", name=f"{prefix}_{name}_cols", layout=col_layout
    )
    return FORMAT, rows, cols
