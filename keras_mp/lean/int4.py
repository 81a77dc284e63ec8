"""The 4-bit moment maps of the lean state: codes, their values, two codes a byte.

After Li et al. (NeurIPS 2023, "Memory Efficient Optimizers with 4-bit States"): small
blocks (128 values a float32 scale, `BLOCK`), a signed non-linear map for the first
moment and a map without a zero point for the second. Both are powers of the code, so
that encoding inverts them with a root instead of a table search:

- first moment (signed): a sign bit and 8 magnitudes `(k / 7) ** 3`, k = 0..7 (smallest
  non-zero 0.29% of the block's maximum; near the dynamic-exponent map's magnitudes).
- second moment (unsigned): 16 codes `((k + 1) / 16) ** 4`, k = 0..15, none of them 0
  (smallest 1.5e-5 of the block's maximum; `sqrt(v)` from 0.39% to 100%). A `v > 0`
  never decodes to 0, so `m / sqrt(v)` cannot blow up (the "zero-point problem").

Codes are rounded stochastically and unbiased in value: up to the next code with
probability equal to the distance from the lower one over their spacing, so an
exponential average whose per-step change is far below one code step still moves in
expectation. The block-wise normalisation (`codecs.encode_moment`) is shared with the
8-bit maps, so blocks follow the same shard-major layout under sharding.
"""

from __future__ import annotations

from keras import ops

__all__ = ["BLOCK", "code", "decode", "pack", "unpack", "value"]

BLOCK = 128  # values per scale (Li et al.: B128 for the first moment)
_SIGNED_TOP = 7.0
_SIGNED_POWER = 3.0
_UNSIGNED_LEVELS = 16.0


def value(codes, signed: bool):
    """The normalized values of 4-bit codes.

    Args:
        codes: float32 tensor of codes in [0, 16) (for `signed`, magnitudes in [0, 8)).
        signed: the first moment's map (magnitudes) or the second moment's.

    Returns:
        A float32 tensor in [0, 1] (`signed`) or (0, 1].
    """
    if signed:
        fraction = codes * (1.0 / _SIGNED_TOP)
        return fraction * fraction * fraction  # _SIGNED_POWER, as products: no exp/log
    return ops.square(ops.square((codes + 1.0) * (1.0 / _UNSIGNED_LEVELS)))


def decode(codes, signed: bool):
    """The normalized values of whole 4-bit codes, the sign bit included.

    Args:
        codes: float32 tensor of codes in [0, 16), as `unpack` gives them.
        signed: the first moment's map (codes 8-15 are the negatives of 0-7) or the
            second moment's.

    Returns:
        A float32 tensor in [-1, 1] (`signed`) or (0, 1].
    """
    if not signed:
        return value(codes, False)
    negative = codes >= 8.0
    magnitude = value(ops.where(negative, codes - 8.0, codes), True)
    return ops.where(negative, -magnitude, magnitude)


def code(values, normalized, noise, signed: bool):
    """4-bit codes of block values, rounded stochastically and unbiased.

    Args:
        values: float32 tensor of the values (their signs are read for `signed`).
        normalized: `abs(values)` over their block's absolute maximum, in [0, 1].
        noise: uniform [0, 1) noise of the same shape, in multiples of 1/1024
            (`codecs.uniforms`).
        signed: True for the first moment's map (the sign in the fourth bit), False for
            the second's (no code decodes to 0).

    Returns:
        A float32 tensor of codes in [0, 16).
    """
    if signed:
        # floor(7 * cbrt(normalized)) clipped to 6, as a count of the code values it
        # reaches: a cube root is exp(log(x) / 3) on most backends, several times the cost
        # of six comparisons.
        low = sum(
            ops.cast(normalized >= (k / _SIGNED_TOP) ** _SIGNED_POWER, "float32")
            for k in range(1, int(_SIGNED_TOP))
        )
    else:
        level = ops.sqrt(ops.sqrt(normalized)) * _UNSIGNED_LEVELS - 1.0
        low = ops.clip(ops.floor(level), 0.0, _UNSIGNED_LEVELS - 2.0)
    below, above = value(low, signed), value(low + 1.0, signed)
    up = ops.clip((normalized - below) / (above - below), 0.0, 1.0)
    # the noise has 10 bits (multiples of 1/1024): centred on its steps, a rounding is
    # biased by at most 1/2048 of a gap either way, zero on average, where `noise < up`
    # would always round up more often (by up to 1/1024 of a gap): with the second
    # moment's beta_2 = 0.999 that bias adds up over ~1000 steps to a sizeable share of
    # a 4-bit gap.
    result = low + ops.cast(noise + 0.5 / 1024.0 < up, "float32")
    if signed:
        result = ops.where(values < 0, result + 8.0, result)
    return result


def pack(codes):
    """`(blocks, length)` codes in [0, 16) as `(blocks, ceil(length / 2))` uint8, two a
    byte (the even position in the low four bits; an odd block is padded with code 0).

    Args:
        codes: float32 or integer tensor of shape `(blocks, length)`.

    Returns:
        A uint8 tensor.
    """
    count, length = codes.shape
    if length % 2:
        codes = ops.pad(codes, [(0, 0), (0, 1)])
    pairs = ops.reshape(ops.cast(codes, "int32"), (count, -1, 2))
    return ops.cast(pairs[:, :, 0] + pairs[:, :, 1] * 16, "uint8")


def unpack(packed, length: int):
    """Inverse of `pack`.

    Args:
        packed: uint8 tensor of shape `(blocks, ceil(length / 2))`.
        length: the values per block.

    Returns:
        A float32 tensor of codes, shape `(blocks, length)`.
    """
    # each byte broadcast to its two positions and shifted by 0 or 4: no concatenation,
    # which XLA would write out whole (4 bytes a code) before the update reads it
    byte = ops.expand_dims(ops.cast(packed, "int32"), 2)
    codes = ops.bitwise_and(ops.right_shift(byte, ops.convert_to_tensor([0, 4], "int32")), 15)
    return ops.cast(ops.reshape(codes, (packed.shape[0], -1))[:, :length], "float32")
