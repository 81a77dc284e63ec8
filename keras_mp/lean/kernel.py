"""The lean Adam/AdamW update of one variable with 4-bit moments, as one Pallas kernel.

Compiled by XLA, `lean_rule` with 4-bit moments runs as two kernels per variable on a GPU
(BENCHMARKS.md 16.4): a reduction over each block of 128 values that computes the new
moments, writes the new weight and both moments as float32 with their blocks' maxima, and
a second kernel that reads them back to encode the codes; the 128-value rows also get
XLA's register-heavy short-row reduction. Here each program of the kernel holds whole
blocks (`rows` blocks of 128 values): it reads the weight, the gradient and the packed
codes once, takes each block's maximum in registers and writes the weight and the codes,
moving 2 + 2 + 1 bytes a value in and out (bfloat16 weight and gradient, two 4-bit codes)
instead of those plus 16 bytes of float32 moments.

The arithmetic is `keras_mp.lean.rule.update`'s, op for op, through the same codec
functions (`lean.codecs`, `lean.int4`) applied to the even and the odd values of each
block (the two codes of a byte): run by Pallas' interpreter it gives the same bits as
`lean_rule` (`tests/test_lean_kernel.py`); compiled by Triton for a GPU, square roots and
divisions may round differently.

It applies (`applies`) to Adam/AdamW with both moments in `"int4"`, any rounding, a
variable in one shard whose values fill whole blocks of a power-of-two length (any
multiple of 128 values); every other variable keeps `lean_rule`. `LeanOptimizer` uses it
on JAX under `KERAS_MP_LEAN_KERNEL=pallas` (opt-in until a GPU has timed it:
`benchmarks/gpu_lean_kernel.sh`).
"""

from __future__ import annotations

import functools
import math

from keras import ops

from keras_mp.lean import codecs as lean_codecs
from keras_mp.lean import int4
from keras_mp.lean.rule import Hyper, Static, noise_seed

__all__ = ["ROWS", "WARPS", "applies", "lean_kernel_rule", "tile_rows"]

ROWS = 8  # blocks per program at most (8 x 128 values: 8 a thread, 64 registers on sm_90a)
WARPS = 4  # warps per program
_IN_PLACE = ("m", "m_scale", "v", "v_scale")


def applies(static: Static, hyper: Hyper, values: dict) -> bool:
    """Whether `lean_kernel_rule` can update this variable (else: `lean_rule`).

    Args:
        static: the variable's `Static`.
        hyper: the optimizer's `Hyper`.
        values: its `lean_rule` inputs.

    Returns:
        True for Adam/AdamW with both moments `"int4"`, a bfloat16 or float32 weight in
        one shard, whole blocks of a power-of-two length and a dense gradient.
    """
    blocks = static.blocks
    size = max(1, math.prod(static.shape))
    return (
        hyper.kind in ("adam", "adamw")
        and static.m == "int4"
        and static.v == "int4"
        and static.weight_dtype in ("bfloat16", "float32")
        and isinstance(blocks, lean_codecs.Blocks)
        and all(n == 1 for n in blocks.shards)
        and blocks.count * blocks.length == size
        and blocks.length >= 2
        and blocks.length & (blocks.length - 1) == 0  # Triton's blocks: powers of two
        and "grad_square" not in values
    )


def tile_rows(count: int, largest: int = ROWS) -> int:
    """Blocks per program: the largest power of two up to `largest` that divides `count`."""
    rows = 1
    while rows < largest and count % (rows * 2) == 0:
        rows *= 2
    return rows


def _decode(code, scale, signed: bool):
    """`codecs.decode_moment`'s int4 arithmetic on float32 codes of `(rows, n)` values
    and their blocks' `(rows, 1)` scales."""
    return int4.decode(code, signed) * scale


def _encode(halves, noises, signed: bool):
    """`codecs.encode_moment`'s int4 arithmetic on a block's even and odd values:
    `(packed uint8 codes, scales)`."""
    scale = ops.maximum(ops.max(ops.abs(halves[0]), axis=1), ops.max(ops.abs(halves[1]), axis=1))
    safe = ops.expand_dims(ops.where(scale > 0, scale, 1.0), 1)
    codes = [
        ops.cast(int4.code(x, ops.abs(x) / safe, noise, signed), "int32")
        for x, noise in zip(halves, noises)
    ]
    return ops.cast(codes[0] + codes[1] * 16, "uint8"), scale


def _kernel(hyper: Hyper, names: tuple, decays: bool, rows: int, length: int, *refs):
    """One program: `rows` blocks of `length` values. `refs`: the float32 scalars
    `(lr, weight_decay * lr, alpha, 0)`, the int32 scalars `(noise seed, finite)`, the
    inputs named in `names`, then the outputs of the same names but `grad`."""
    import jax
    from jax.experimental import pallas as pl

    floats, ints = refs[0], refs[1]
    given = dict(zip(names, refs[2 : 2 + len(names)]))
    out = dict(zip([n for n in names if n != "grad"], refs[2 + len(names) :]))
    half = length // 2
    wd_lr, alpha = floats[1], floats[2]
    seed, finite = ints[0], ints[1] != 0
    base = pl.program_id(0) * rows
    row = jax.lax.broadcasted_iota("int32", (rows, half), 0)
    col = jax.lax.broadcasted_iota("int32", (rows, half), 1)
    codes = {name: ops.cast(given[name][...], "int32") for name in ("m", "v")}
    scales = {name: ops.expand_dims(given[name + "_scale"][...], 1) for name in ("m", "v")}
    moments = {"m": [], "v": []}
    noises = {"m": [], "v": []}
    for p in (0, 1):  # the even and the odd values of each block: a byte's two codes
        part = pl.ds(p, half, stride=2)
        index = (base + row) * length + 2 * col + p
        noise_w, noise_m, noise_v = lean_codecs.uniform_fields(
            lean_codecs.hash_index(index, seed), 3
        )
        weight = given["weight"][:, part]
        comp = given["compensation"][:, part] if "compensation" in given else None
        w = lean_codecs.decode_weight(weight, comp, hyper.rounding)
        g = ops.cast(given["grad"][:, part], "float32")
        code_m = ops.cast(ops.bitwise_and(ops.right_shift(codes["m"], 4 * p), 15), "float32")
        code_v = ops.cast(ops.bitwise_and(ops.right_shift(codes["v"], 4 * p), 15), "float32")
        m = _decode(code_m, scales["m"], True)
        v = _decode(code_v, scales["v"], False)
        update = ops.zeros_like(w)
        if decays:
            update = update - w * wd_lr
        m = m + (g - m) * (1.0 - hyper.beta_1)
        v = v + (ops.square(g) - v) * (1.0 - hyper.beta_2)
        update = update - alpha * m / (ops.sqrt(v) + hyper.epsilon)
        target = w + update
        if str(weight.dtype) == "bfloat16":
            new_weight, new_comp = lean_codecs.encode_weight(target, hyper.rounding, noise_w)
        else:
            new_weight, new_comp = ops.cast(target, weight.dtype), None
        out["weight"][:, part] = ops.where(finite, new_weight, weight)
        if comp is not None:
            out["compensation"][:, part] = ops.where(finite, new_comp, comp)
        moments["m"].append(m)
        moments["v"].append(v)
        noises["m"].append(noise_m)
        noises["v"].append(noise_v)
    for name, signed in (("m", True), ("v", False)):
        packed, scale = _encode(moments[name], noises[name], signed)
        out[name][...] = ops.where(finite, packed, given[name][...])
        out[name + "_scale"][...] = ops.where(finite, scale, given[name + "_scale"][...])


def lean_kernel_rule(
    static: Static,
    hyper: Hyper,
    values: dict,
    interpret: bool | None = None,
    rows: int | None = None,
    warps: int = WARPS,
) -> dict:
    """`lean_rule` for a variable `applies` accepts, as one Pallas kernel.

    Args:
        static: the variable's `Static`.
        hyper: the optimizer's `Hyper` (Adam/AdamW).
        values: as `lean_rule`'s: `weight`, `grad`, `lr`, `iterations`, `seed`, `m`,
            `m_scale`, `v`, `v_scale`, and `compensation`, `weight_decay` where they apply.
        interpret: True: Pallas' interpreter (any backend); False: the Triton kernel
            (a CUDA GPU); None: chosen where the step is lowered (the kernel for CUDA, the
            interpreter elsewhere, e.g. on a CPU).
        rows: blocks per program (a power of two dividing the blocks' count; default
            `tile_rows`).
        warps: warps per program.

    Returns:
        The dict `lean_rule` returns: the new `weight`, `m`, `m_scale`, `v`, `v_scale`
        and `compensation` where given; all as given when the gradient has an inf or NaN.

    Example:

    ```python
    if applies(static, hyper, values):
        new = lean_kernel_rule(static, hyper, values)
    ```
    """
    import jax
    from jax.experimental import pallas as pl

    count, length = static.blocks.count, static.blocks.length
    rows = rows or tile_rows(count)
    if count % rows:
        raise ValueError(f"lean_kernel_rule: rows={rows} does not divide {count} blocks.")
    g = values["grad"]
    finite = ops.all(ops.isfinite(g))
    lr = values["lr"]
    step = ops.cast(values["iterations"] + 1, "float32")
    correction = ops.sqrt(1.0 - ops.power(hyper.beta_2, step))
    alpha = lr * correction / (1.0 - ops.power(hyper.beta_1, step))
    decays = "weight_decay" in values
    wd_lr = values["weight_decay"] * lr if decays else ops.zeros((), "float32")
    floats = ops.stack([ops.cast(lr, "float32"), ops.cast(wd_lr, "float32"), alpha, 0.0 * alpha])
    seed = noise_seed(values["iterations"], values["seed"])
    ints = ops.stack([ops.cast(seed, "int32"), ops.cast(finite, "int32")])

    names = ["weight", "grad"]
    inputs = [ops.reshape(values["weight"], (count, length)), ops.reshape(g, (count, length))]
    if "compensation" in values:
        names.append("compensation")
        inputs.append(ops.reshape(values["compensation"], (count, length)))
    for name in ("m", "v"):
        names += [name, name + "_scale"]
        inputs += [values[name], values[name + "_scale"]]

    def spec(x):
        if len(x.shape) == 1:
            return pl.BlockSpec((rows,), lambda i: (i,))
        return pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))

    scalar = pl.BlockSpec((4,), lambda i: (0,))
    int_scalar = pl.BlockSpec((2,), lambda i: (0,))
    outputs = [(n, x) for n, x in zip(names, inputs) if n != "grad"]

    # The moments are updated in place. The weight is not: the backward pass reads it too
    # (for the layer's input gradient), in no set order with this update, and XLA would
    # copy it whole to let the kernel write over it.
    aliases = {2 + names.index(n): k for k, (n, _) in enumerate(outputs) if n in _IN_PLACE}

    def call(interpreted: bool):
        return pl.pallas_call(
            functools.partial(_kernel, hyper, tuple(names), decays, rows, length),
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x in outputs],
            grid=(count // rows,),
            in_specs=[scalar, int_scalar] + [spec(x) for x in inputs],
            out_specs=[spec(x) for _, x in outputs],
            input_output_aliases=aliases,
            interpret=interpreted,
            compiler_params=None if interpreted else _triton_params(warps),
            name="lean_int4_update",
        )

    if interpret is None:  # chosen where the step is lowered: Triton for CUDA
        results = jax.lax.platform_dependent(
            floats, ints, *inputs, cuda=call(False), default=call(True)
        )
    else:
        results = call(interpret)(floats, ints, *inputs)
    new = {n: x for (n, _), x in zip(outputs, results)}
    new["weight"] = ops.reshape(new["weight"], static.shape)
    if "compensation" in new:
        new["compensation"] = ops.reshape(new["compensation"], static.shape)
    return new


def _triton_params(warps: int):
    """Triton, not Mosaic GPU (which JAX may pick by default)."""
    from jax.experimental.pallas import triton as pltriton

    params = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
    return params(num_warps=warps, num_stages=1)
