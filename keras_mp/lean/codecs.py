"""How the lean training state is stored: pure encode/decode functions in `keras.ops`.

The lean state keeps trainable weights in bfloat16 and optimizer moments in 8 bits or
bfloat16; every update is computed in float32 inside the train step and written back
through these codecs. Each is a pure function of float32 values (and, where it rounds
stochastically, of random bits derived from the step and the variable), so the same code
runs in the stateful (TensorFlow) and stateless (JAX) paths, with and without XLA, and
two runs with the same inputs produce the same bits.

Weights (`encode_weight` / `decode_weight`):

- `"kahan"`: the bfloat16 weight is the float32 target rounded to nearest; what the
  rounding lost is kept in an int8 compensation buffer in units of 1/254 of the weight's
  bfloat16 ulp, rounded stochastically (Kahan summation with a compact buffer: about 16
  significant bits, and unbiased below that; 3 bytes a parameter). Small updates
  accumulate in the buffer until they move the weight.
- `"kahan16"`: the same with a bfloat16 compensation buffer (4 bytes a parameter).
- `"stochastic"`: the weight alone, rounded up or down with probabilities that make it
  unbiased (2 bytes a parameter).

Moments (`encode_moment` / `decode_moment`):

- `"int8"`: block-wise 8-bit codes with one float32 scale (the block's absolute maximum)
  per `block` values: a signed companded map for the first moment, an unsigned one with
  no zero point for the second (a non-zero second moment never decodes to zero, so
  `m / sqrt(v)` cannot blow up). Codes are rounded stochastically, so an exponential
  average whose per-step change is below one code step still moves in expectation.
- `"int4"`: the same blocks with 4-bit codes, two a byte, 128 values a scale by default
  (`keras_mp.lean.int4`: a signed cubic map for the first moment, a zero-point-free one
  for the second, after Li et al., NeurIPS 2023).
- `"bfloat16"`: stochastically rounded bfloat16.
- `"float32"`: as the float32 optimizer stores it (for comparison).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from keras import ops

from keras_mp.lean import int4

__all__ = [
    "MOMENT_FORMATS",
    "QUANTIZED",
    "ROUNDINGS",
    "decode_moment",
    "decode_weight",
    "encode_moment",
    "encode_weight",
    "Blocks",
    "block_for",
    "blocks_for",
    "moment_shapes",
    "hash_index",
    "random_bits",
    "uniform_fields",
    "uniforms",
    "stochastic_round_bfloat16",
]

ROUNDINGS = ("kahan", "kahan16", "stochastic")
MOMENT_FORMATS = ("int8", "int4", "bfloat16", "float32")
QUANTIZED = ("int8", "int4")  # block-wise codes with a float32 scale per block

# Companding of the 8-bit moment maps: value = scale * (code / top) ** power, power 2 for
# the first moment (127 magnitudes, relative step 1.6% at the block's max, smallest
# non-zero 6e-5 of it) and 4 for the second (~ g**2: 255 codes, no zero point; sqrt(v) as
# precise as m). Square roots and squares only: cheap on every backend.
_SIGNED_TOP = 127.0
_UNSIGNED_TOP = 255.0
_KAHAN_STEPS = 254.0  # int8 compensation: units of ulp / 254, |code| <= 127


# -- random bits --------------------------------------------------------------------


def _as_int32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def random_bits(shape, seed) -> object:
    """16 uniformly distributed random bits per element, as int32 in [0, 65536).

    A counter-based hash (murmur3's finaliser) of each element's index and `seed`: no
    random-number state, identical on every backend, with and without XLA.

    Args:
        shape: the shape of the result.
        seed: an int32 scalar (tensor or int); different seeds give independent bits.

    Returns:
        An int32 tensor of `shape`.
    """
    bits = ops.bitwise_and(_hash(shape, seed), _uint32(0xFFFF))
    return ops.reshape(ops.cast(bits, "int32"), shape)


def _hash(shape, seed):
    """32 hashed bits (uint32) for each element of a flattened `shape`, from its index
    and `seed`.

    Unsigned arithmetic: the same bits as wrapping int32 arithmetic, and its right shifts
    are logical without a mask (three fewer operations per element than int32's)."""
    return hash_index(ops.arange(max(1, math.prod(shape)), dtype="int32"), seed)


def hash_index(index, seed):
    """32 hashed bits (uint32) of each element index in `index` (int32 or uint32) under
    `seed` (an int32 tensor broadcastable against `index`): `random_bits`' and
    `uniforms`' hash, for callers that lay several variables' elements out together."""
    key = _mix(ops.cast(ops.cast(seed, "int32"), "uint32") + _uint32(0x6A09E667))
    return _mix(ops.cast(index, "uint32") * _uint32(0x9E3779B1) + key)


def _uint32(value: int):
    return ops.convert_to_tensor(value, dtype="uint32")


def _mix(h):
    """murmur3's 32-bit finaliser (uint32 `h`, wrapping arithmetic)."""
    h = ops.bitwise_xor(h, ops.right_shift(h, 16))
    h = ops.multiply(h, _uint32(0x85EBCA6B))
    h = ops.bitwise_xor(h, ops.right_shift(h, 13))
    h = ops.multiply(h, _uint32(0xC2B2AE35))
    return ops.bitwise_xor(h, ops.right_shift(h, 16))


def uniforms(shape, seed, count: int = 3) -> list:
    """`count` (at most 3) independent uniform tensors in [0, 1) of `shape`, 10 random
    bits each, from one hash per element (`random_bits`' hash, all 32 bits used): the
    noise of one variable's stochastic roundings (weight, first and second moment).

    Args:
        shape: the shape of each result.
        seed: an int32 scalar.
        count: how many (1 to 3).

    Returns:
        A list of float32 tensors.
    """
    if not 1 <= count <= 3:
        raise ValueError(f"uniforms: count must be 1, 2 or 3, got {count}.")
    return [ops.reshape(u, shape) for u in uniform_fields(_hash(shape, seed), count)]


def uniform_fields(h, count: int = 3) -> list:
    """`count` uniform [0, 1) float32 tensors, 10 bits each, from the hashed bits `h`
    (uint32, `hash_index`): bits 0-9, 10-19 and 20-29."""
    out = []
    for i in range(count):
        field = ops.bitwise_and(ops.right_shift(h, 10 * i) if i else h, _uint32(0x3FF))
        out.append(ops.cast(field, "float32") * (1.0 / 1024.0))
    return out


def _bits(noise):
    """Uniform noise in [0, 1) as the 16 random bits `stochastic_round_bfloat16` adds."""
    return ops.cast(noise * 65536.0, "int32")


# -- bfloat16 rounding --------------------------------------------------------------


def stochastic_round_bfloat16(x, bits):
    """`x` (float32) rounded to bfloat16, up or down at random, unbiased.

    Adds 16 random bits below bfloat16's last mantissa bit and truncates: `x` becomes
    its upper neighbour with probability equal to its distance from the lower one, in
    ulps. Non-finite values stay non-finite.

    Args:
        x: float32 tensor.
        bits: int32 tensor of `x`'s shape with values in [0, 65536) (`random_bits`).

    Returns:
        A bfloat16 tensor.
    """
    x = ops.cast(x, "float32")
    raw = ops.view(x, "int32")
    rounded = ops.bitwise_and(raw + bits, _as_int32(0xFFFF0000))
    finite = ops.isfinite(x)
    out = ops.where(finite, ops.view(rounded, "float32"), x)
    return ops.cast(out, "bfloat16")


def _bfloat16_ulp(w):
    """The spacing of bfloat16 numbers at `w` (float32 holding bfloat16 values): its
    exponent bits, read directly, times 2**-7 (zero and subnormals: the smallest normal's)."""
    exponent = ops.bitwise_and(ops.view(ops.cast(w, "float32"), "int32"), 0x7F800000)
    power = ops.view(ops.maximum(exponent, 0x00800000), "float32")  # 2**floor(log2|w|)
    return power * (2.0**-7)


def encode_weight(target, rounding: str, noise=None):
    """A float32 weight as its lean storage.

    Args:
        target: float32 tensor, the exact new weight.
        rounding: one of `ROUNDINGS`.
        noise: uniform [0, 1) noise of `target`'s shape (`uniforms`) for the stochastic
            rounding of `"stochastic"` weights and of `"kahan"`'s int8 compensation
            (default: `uniforms(shape, 0)`; unused by `"kahan16"`).

    Returns:
        `(weight, compensation)`: the bfloat16 weight and the compensation buffer
        (int8 for `"kahan"`, bfloat16 for `"kahan16"`, None for `"stochastic"`).
    """
    target = ops.cast(target, "float32")
    if noise is None:
        noise = uniforms(tuple(target.shape), 0, 1)[0]
    if rounding == "stochastic":
        return stochastic_round_bfloat16(target, _bits(noise)), None
    weight = ops.cast(target, "bfloat16")
    residual = target - ops.cast(weight, "float32")
    if rounding == "kahan16":
        return weight, ops.cast(residual, "bfloat16")
    if rounding != "kahan":
        raise ValueError(f"Unknown rounding {rounding!r}; expected one of {ROUNDINGS}.")
    units = residual / _bfloat16_ulp(ops.cast(weight, "float32")) * _KAHAN_STEPS
    # Rounded stochastically: a fixed step below half a unit (ulp / 508) still adds up.
    code = ops.clip(ops.floor(units + noise), -127.0, 127.0)
    return weight, ops.cast(ops.where(ops.isfinite(code), code, 0.0), "int8")


def decode_weight(weight, compensation, rounding: str):
    """The float32 weight a lean weight and its compensation buffer stand for.

    Args:
        weight: bfloat16 tensor.
        compensation: the buffer `encode_weight` returned (None for `"stochastic"`).
        rounding: one of `ROUNDINGS`.

    Returns:
        A float32 tensor.
    """
    w = ops.cast(weight, "float32")
    if compensation is None or rounding == "stochastic":
        return w
    if rounding == "kahan16":
        return w + ops.cast(compensation, "float32")
    units = ops.cast(compensation, "float32") * (1.0 / _KAHAN_STEPS)
    return w + units * _bfloat16_ulp(w)


# -- moments ------------------------------------------------------------------------


def block_for(shape, block: int) -> int:
    """The block length used for a tensor of `shape`: at most `block`, with the tensor
    split into equal blocks (less than one value of padding per block)."""
    size = max(1, math.prod(shape))
    blocks = -(-size // block)
    return -(-size // blocks)


class Blocks(NamedTuple):
    """How a tensor's values are grouped into the blocks of an 8-bit moment.

    The tensor is cut into `shards` (how many parts each dimension is split into, as its
    sharding across devices splits it); each shard's values, in row-major order, fill
    `per_shard` consecutive blocks of `length` values (the last one padded). No block
    holds values of two shards, so a device that holds a shard of the weight holds whole
    blocks and their scales.

    Attributes:
        shards: parts per dimension of the tensor (all 1: one shard).
        per_shard: blocks per shard.
        length: values per block.
    """

    shards: tuple
    per_shard: int
    length: int

    @property
    def count(self) -> int:
        """All blocks: the first dimension of the codes, the length of the scales."""
        return math.prod(self.shards) * self.per_shard


def blocks_for(shape, block: int, shards=None, chunks: int = 1) -> Blocks:
    """The `Blocks` of a tensor of `shape`, at most `block` values each.

    Args:
        shape: the tensor's shape.
        block: the largest block length.
        shards: parts per dimension (default: one shard); each must divide its dimension.
        chunks: the blocks of each shard are a multiple of this (to split the codes
            further across devices, e.g. a data-parallel axis, without padding blocks).

    Returns:
        A `Blocks`.
    """
    shape = tuple(int(d) for d in shape)
    shards = tuple(shards) if shards is not None else (1,) * len(shape)
    if len(shards) != len(shape) or any(d % n for d, n in zip(shape, shards)):
        raise ValueError(f"blocks_for: shards {shards} do not divide the shape {shape}.")
    per_shard_values = max(1, math.prod(shape) // math.prod(shards))
    per_shard = -(-per_shard_values // block)
    per_shard = -(-per_shard // chunks) * chunks
    return Blocks(shards, per_shard, -(-per_shard_values // per_shard))


def _as_blocks(layout, shape) -> Blocks:
    if isinstance(layout, Blocks):
        return layout
    return blocks_for(shape, layout)


def moment_shapes(shape, fmt: str, block) -> tuple:
    """Shapes of a moment's storage: `(codes_shape, scales_shape or None)`.

    Args:
        shape: the tensor's shape.
        fmt: one of `MOMENT_FORMATS`.
        block: the largest block length, or the `Blocks` (`blocks_for`) to use.
    """
    if fmt not in QUANTIZED:
        return tuple(shape), None
    layout = _as_blocks(block, shape)
    if fmt == "int4":  # two codes a byte
        return (layout.count, -(-layout.length // 2)), (layout.count,)
    return (layout.count, layout.length), (layout.count,)


def _shard_major(x, shards):
    """`x` reshaped to `(shards, values of each shard in row-major order)`."""
    shape = tuple(x.shape)
    split = []
    for d, n in zip(shape, shards):
        split += [n, d // n]
    x = ops.reshape(x, split or (1,))
    rank = len(shape)
    x = ops.transpose(x, [2 * i for i in range(rank)] + [2 * i + 1 for i in range(rank)])
    return ops.reshape(x, (math.prod(shards), -1))


def _from_shard_major(x, shards, shape):
    """Inverse of `_shard_major`."""
    rank = len(shape)
    x = ops.reshape(x, tuple(shards) + tuple(d // n for d, n in zip(shape, shards)))
    order = [0] * (2 * rank)
    for i in range(rank):
        order[2 * i], order[2 * i + 1] = i, rank + i
    return ops.reshape(ops.transpose(x, order) if rank else x, shape)


def _blocks(x, layout: Blocks):
    """The values of `x` as `(layout.count, layout.length)` blocks (zero padded)."""
    x = ops.cast(x, "float32")
    values = _shard_major(x, layout.shards) if x.shape else ops.reshape(x, (1, 1))
    size = values.shape[1]
    pad = layout.per_shard * layout.length - size
    if pad:
        values = ops.pad(values, [(0, 0), (0, pad)])
    return ops.reshape(values, (layout.count, layout.length))


def _unblocks(values, layout: Blocks, shape):
    """Inverse of `_blocks`."""
    shards = math.prod(layout.shards)
    size = max(1, math.prod(shape)) // shards
    values = ops.reshape(values, (shards, layout.per_shard * layout.length))[:, :size]
    if not shape:
        return ops.reshape(values, ())
    return _from_shard_major(values, layout.shards, tuple(shape))


def _block_max(values):
    """The maximum of each row of `(blocks, length)` values: the blocks' scales. One
    reduction; `benchmarks/lean_codec_parts.py` swaps in a two-step form to time it
    against (BENCHMARKS.md 16.4)."""
    return ops.max(values, axis=1)


def encode_moment(x, fmt: str, signed: bool, noise=None, block=2048):
    """A float32 optimizer moment as its compact storage, rounded stochastically.

    Args:
        x: float32 tensor (the first moment when `signed`, else the second, >= 0).
        fmt: one of `MOMENT_FORMATS`.
        signed: True for a signed map (first moment), False for the unsigned map.
        noise: uniform [0, 1) noise of `x`'s shape (`uniforms`; default
            `uniforms(shape, 0)`) for the stochastic rounding.
        block: for `"int8"`/`"int4"`, the largest number of values per scale, or the `Blocks`
            (`blocks_for`) to use.

    Returns:
        `(codes, scales)`: for `"int8"`, uint8 codes of shape `(blocks, length)` (for
        `"int4"`, `(blocks, ceil(length / 2))`, two codes a byte) and
        their float32 scales `(blocks,)`; otherwise the stored tensor and None.
    """
    x = ops.cast(x, "float32")
    if fmt == "float32":
        return x, None
    if noise is None:
        noise = uniforms(tuple(x.shape), 0, 1)[0]
    if fmt == "bfloat16":
        return stochastic_round_bfloat16(x, _bits(noise)), None
    if fmt not in QUANTIZED:
        raise ValueError(f"Unknown moment format {fmt!r}; expected one of {MOMENT_FORMATS}.")
    layout = _as_blocks(block, tuple(x.shape))
    values = _blocks(x, layout)
    scale = _block_max(ops.abs(values))
    safe = ops.where(scale > 0, scale, 1.0)
    normalized = ops.abs(values) / ops.expand_dims(safe, 1)
    noise = _blocks(noise, layout)
    if fmt == "int4":
        return int4.pack(int4.code(values, normalized, noise, signed)), scale
    if signed:
        level = ops.sqrt(normalized) * _SIGNED_TOP
        magnitude = ops.minimum(ops.floor(level + noise), _SIGNED_TOP)
        code = ops.where(values < 0, 128.0 + magnitude, magnitude)  # sign in the top bit
    else:
        level = ops.sqrt(ops.sqrt(normalized)) * _UNSIGNED_TOP
        code = ops.minimum(ops.floor(level + noise), _UNSIGNED_TOP)
        code = ops.where(values > 0, ops.maximum(code, 1.0), 0.0)  # no zero for v > 0
    return ops.cast(code, "uint8"), scale


def decode_moment(codes, scales, fmt: str, signed: bool, shape, block=None):
    """The float32 moment of `shape` that `encode_moment`'s output stands for.

    Args:
        codes, scales: `encode_moment`'s output.
        fmt: one of `MOMENT_FORMATS`.
        signed: as given to `encode_moment`.
        shape: the moment's shape.
        block: the `Blocks` it was encoded with (default: one shard, blocks as long as
            the codes' rows).

    Returns:
        A float32 tensor of `shape`.
    """
    if fmt not in QUANTIZED:
        return ops.cast(codes, "float32")
    if isinstance(block, int):
        block = blocks_for(shape, block)
    elif not isinstance(block, Blocks):  # the codes' rows (int4: exact for even lengths)
        count, length = codes.shape
        length = 2 * int(length) if fmt == "int4" else int(length)
        block = Blocks((1,) * len(shape), int(count), length)
    if fmt == "int4":
        value = int4.decode(int4.unpack(codes, block.length), signed)
    else:
        code = ops.cast(codes, "float32")
        if signed:
            negative = code >= 128.0
            magnitude = ops.where(negative, code - 128.0, code)
            value = ops.square(magnitude * (1.0 / _SIGNED_TOP))
            value = ops.where(negative, -value, value)
        else:
            value = ops.square(ops.square(code * (1.0 / _UNSIGNED_TOP)))
    value = value * ops.expand_dims(scales, 1)
    return _unblocks(value, block, tuple(shape))
