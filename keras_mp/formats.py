"""Facts about the floating-point formats used in mixed precision, and rounding helpers.

Everything here is plain numpy + `ml_dtypes` (no Keras, no TensorFlow), so it can be
used in notebooks, audits and tests to answer "does this value survive in that format?".

Formats: `"float32"`, `"tf32"` (NVIDIA TensorFloat-32: float32 range, 10 mantissa bits,
only a compute format, so it has no numpy dtype), `"float16"`, `"bfloat16"`,
`"float8_e4m3fn"` (FP8 forward format, no infinities) and `"float8_e5m2"` (FP8
gradient format).

Rounding is IEEE round-to-nearest-even, without saturation: a value beyond `max`
becomes `inf` (`nan` for `float8_e4m3fn`, which has no infinity).

Example:

```python
from keras_mp import formats

formats.info("float16").max                      # 65504.0
formats.ulp(1.0, "float16")                      # 0.0009765625 == 2**-10
formats.update_is_lost(1.0, 1e-4, "float16")     # True: 1 + 1e-4 rounds back to 1
formats.underflows([1e-8, 1e-3], "float16")      # array([ True, False])
```
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

__all__ = [
    "FORMATS",
    "FormatInfo",
    "info",
    "round_to",
    "ulp",
    "underflows",
    "update_is_lost",
]


@dataclasses.dataclass(frozen=True)
class FormatInfo:
    """Facts about one binary floating-point format.

    Attributes:
        name: Canonical format name, e.g. `"bfloat16"`.
        bits: Total storage bits (19 for `tf32`, which is stored in 32-bit registers).
        exponent_bits: Width of the exponent field.
        mantissa_bits: Explicit mantissa (fraction) bits; precision is this plus one.
        max: Largest finite value.
        smallest_normal: Smallest positive normal value, `2**min_exponent`.
        smallest_subnormal: Smallest positive value, `smallest_normal * epsilon`.
        epsilon: Gap between 1.0 and the next larger value, `2**-mantissa_bits`.
        min_exponent: Exponent of `smallest_normal`.
        has_inf: Whether the format can represent infinity.
        numpy_dtype: The numpy dtype storing the format, `None` for `tf32`.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    epsilon: float
    min_exponent: int
    has_inf: bool
    numpy_dtype: np.dtype | None


def _from_numpy(name: str, dtype) -> FormatInfo:
    dtype = np.dtype(dtype)
    fi = ml_dtypes.finfo(dtype)
    return FormatInfo(
        name=name,
        bits=fi.bits,
        exponent_bits=int(fi.nexp),
        mantissa_bits=int(fi.nmant),
        max=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=float(fi.smallest_subnormal),
        epsilon=float(fi.eps),
        min_exponent=int(fi.minexp),
        has_inf=bool(np.isinf(np.array(np.inf).astype(dtype))),
        numpy_dtype=dtype,
    )


_TF32 = FormatInfo(
    name="tf32",
    bits=19,
    exponent_bits=8,
    mantissa_bits=10,
    max=float((2.0 - 2.0**-10) * 2.0**127),
    smallest_normal=2.0**-126,
    smallest_subnormal=2.0**-136,
    epsilon=2.0**-10,
    min_exponent=-126,
    has_inf=True,
    numpy_dtype=None,
)

FORMATS: dict[str, FormatInfo] = {
    "float32": _from_numpy("float32", np.float32),
    "tf32": _TF32,
    "float16": _from_numpy("float16", np.float16),
    "bfloat16": _from_numpy("bfloat16", ml_dtypes.bfloat16),
    "float8_e4m3fn": _from_numpy("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": _from_numpy("float8_e5m2", ml_dtypes.float8_e5m2),
}


def info(name) -> FormatInfo:
    """Returns the `FormatInfo` of a format.

    Args:
        name: A format name (`"float32"`, `"tf32"`, `"float16"`, `"bfloat16"`,
            `"float8_e4m3fn"`, `"float8_e5m2"`) or a numpy dtype of one of them.

    Returns:
        The frozen `FormatInfo` for that format.

    Raises:
        ValueError: if `name` is not one of the formats above.

    Example:

    >>> info("bfloat16").epsilon == 2.0**-7
    True
    """
    key = name
    if not isinstance(name, str):
        try:
            key = np.dtype(name).name
        except TypeError:
            key = repr(name)
    if key not in FORMATS:
        raise ValueError(
            f"Unknown floating-point format: dtype={name!r}. "
            f"Valid choices: {', '.join(repr(k) for k in FORMATS)}."
        )
    return FORMATS[key]


def _output(result: np.ndarray, like):
    """Returns a Python scalar for scalar input, else the array."""
    return result.item() if np.ndim(like) == 0 else result


def _round64(x, fmt: FormatInfo) -> np.ndarray:
    """Rounds `x` to `fmt`, returned as float64 holding exactly representable values."""
    x = np.asarray(x, dtype=np.float64)
    if fmt.numpy_dtype is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            return x.astype(fmt.numpy_dtype).astype(np.float64)
    # No numpy dtype (tf32): scale each value's ulp to 1, round half to even, scale back.
    # Exact in float64, because all scalings are by powers of two.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        exponent = np.floor(np.log2(np.abs(x)))
        exponent = np.where(np.isfinite(exponent), exponent, fmt.min_exponent)
        exponent = np.maximum(exponent, fmt.min_exponent)
        step = np.exp2(exponent - fmt.mantissa_bits)
        rounded = np.round(x / step) * step
        rounded = np.where(np.abs(rounded) > fmt.max, np.copysign(np.inf, x), rounded)
    return np.where(np.isfinite(x), rounded, x)


def round_to(x, dtype):
    """Rounds values to the nearest value representable in a format.

    Args:
        x: A number or array-like.
        dtype: A format name, see `info()`.

    Returns:
        float64 value(s) holding exactly the rounded numbers (a Python float for scalar
        input), so results of different formats can be compared directly.

    Example:

    >>> round_to(1.0 + 2.0**-12, "float16")
    1.0
    >>> round_to(3.14159, "tf32")
    3.140625
    """
    return _output(_round64(x, info(dtype)), x)


def ulp(w, dtype):
    """Unit in the last place: the gap between `|w|` and the next larger value in a format.

    `w` is first rounded to the format. Below the smallest normal number the gap is the
    smallest subnormal; for values that overflow it is `inf`.

    Args:
        w: A number or array-like.
        dtype: A format name, see `info()`.

    Returns:
        The ulp(s) as float64 (a Python float for scalar input).

    Example:

    >>> ulp(1.0, "float16") == 2.0**-10
    True
    >>> ulp(1024.0, "bfloat16")
    8.0
    """
    fmt = info(dtype)
    w_r = np.abs(_round64(w, fmt))
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.floor(np.log2(w_r))
        exponent = np.where(np.isfinite(exponent), exponent, fmt.min_exponent)
        exponent = np.maximum(exponent, fmt.min_exponent)
        result = np.exp2(exponent - fmt.mantissa_bits)
    result = np.where(np.isfinite(w_r), result, np.where(np.isnan(w_r), np.nan, np.inf))
    return _output(result, w)


def update_is_lost(w, dw, dtype):
    """Whether adding an update to a weight stored in a format leaves the weight unchanged.

    The weight is rounded to the format, the update is added exactly and the sum rounded
    to the format again: the update is lost when that gives back the stored weight. This is
    why master weights are kept in float32: small learning-rate updates vanish in float16
    and bfloat16.

    Args:
        w: Weight value(s).
        dw: Update value(s), broadcastable against `w`.
        dtype: A format name, see `info()`.

    Returns:
        Boolean(s): `True` where `round(w + dw) == round(w)` (a Python bool for scalars).

    Example:

    >>> update_is_lost(1.0, 1e-4, "float16")
    True
    >>> update_is_lost(1.0, 1e-4, "float32")
    False
    """
    fmt = info(dtype)
    w_r = _round64(w, fmt)
    summed = _round64(w_r + np.asarray(dw, dtype=np.float64), fmt)
    result = summed == w_r
    return _output(result, result)


def underflows(x, dtype):
    """Which nonzero values become zero when rounded to a format.

    Args:
        x: A number or array-like (e.g. gradients times the current loss scale).
        dtype: A format name, see `info()`.

    Returns:
        Boolean(s), `True` where `x != 0` and `round_to(x, dtype) == 0` (a Python bool
        for scalar input).

    Example:

    >>> underflows([1e-8, 1e-3, 0.0], "float16").tolist()
    [True, False, False]
    """
    fmt = info(dtype)
    x64 = np.asarray(x, dtype=np.float64)
    result = (x64 != 0) & (_round64(x64, fmt) == 0)
    return _output(result, x)
