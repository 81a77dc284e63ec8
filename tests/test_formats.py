"""Tests for keras_mp.formats: textbook facts and rounding helpers (numpy only)."""

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from keras_mp import formats


def test_float16_textbook_numbers():
    fp16 = formats.info("float16")
    assert (fp16.exponent_bits, fp16.mantissa_bits, fp16.bits) == (5, 10, 16)
    assert fp16.max == 65504.0
    assert fp16.smallest_normal == 2.0**-14
    assert fp16.smallest_subnormal == 2.0**-24
    assert fp16.epsilon == 2.0**-10
    assert fp16.has_inf


# name: (exponent bits, mantissa bits, max, smallest normal, smallest subnormal, epsilon)
FACTS = {
    "float32": (8, 23, float(np.finfo(np.float32).max), 2.0**-126, 2.0**-149, 2.0**-23),
    "tf32": (8, 10, (2 - 2.0**-10) * 2.0**127, 2.0**-126, 2.0**-136, 2.0**-10),
    "bfloat16": (8, 7, (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7),
    "float8_e4m3fn": (4, 3, 448.0, 2.0**-6, 2.0**-9, 2.0**-3),
    "float8_e5m2": (5, 2, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
}


def test_format_facts():
    assert set(FACTS) | {"float16"} == set(formats.FORMATS)
    for name, (exp_bits, man_bits, max_value, normal, subnormal, eps) in FACTS.items():
        fmt = formats.info(name)
        assert fmt.name == name
        assert (fmt.exponent_bits, fmt.mantissa_bits) == (exp_bits, man_bits), name
        assert (fmt.max, fmt.smallest_normal, fmt.smallest_subnormal, fmt.epsilon) == (
            max_value, normal, subnormal, eps), name
    for name, fmt in formats.FORMATS.items():
        # The facts agree with rounding: max survives, twice max overflows, the smallest
        # subnormal survives and half of it rounds (to even) to zero.
        assert formats.round_to(fmt.max, name) == fmt.max, name
        assert not np.isfinite(formats.round_to(2 * fmt.max, name)), name
        assert formats.round_to(fmt.smallest_subnormal, name) == fmt.smallest_subnormal, name
        assert formats.round_to(fmt.smallest_subnormal / 2, name) == 0.0, name


def test_info_details():
    assert not formats.info("float8_e4m3fn").has_inf
    assert formats.info("float8_e5m2").has_inf
    assert np.isnan(formats.round_to(1000.0, "float8_e4m3fn"))  # no inf to overflow to
    fmt = formats.info("bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.max = 1.0
    assert formats.info(ml_dtypes.bfloat16) is fmt
    assert formats.info(np.float16) is formats.info("float16")


def test_unknown_format_lists_valid_choices():
    for bad in ["fp16", "half", "float64", 3]:
        with pytest.raises(ValueError, match="float8_e4m3fn") as err:
            formats.info(bad)
        assert "tf32" in str(err.value) and repr(bad) in str(err.value)
    with pytest.raises(ValueError, match="Valid choices"):
        formats.ulp(1.0, "fp8")


def test_ulp():
    assert formats.ulp(1.0, "float16") == 2.0**-10
    assert formats.ulp(1.0, "float32") == 2.0**-23
    assert formats.ulp(1.0, "bfloat16") == 2.0**-7
    assert formats.ulp(1024.0, "bfloat16") == 8.0
    assert formats.ulp(-3.0, "float16") == 2.0**-9  # sign does not matter
    # Below the smallest normal, the gap is the smallest subnormal (also at zero).
    assert formats.ulp(0.0, "float16") == 2.0**-24
    assert formats.ulp(1e-6, "float16") == 2.0**-24
    # Agrees with numpy's own spacing for the formats numpy has.
    w = np.array([1e-3, 0.7, 3.0, 1000.0, 60000.0])
    np.testing.assert_array_equal(formats.ulp(w, "float16"), np.spacing(w.astype(np.float16)))
    np.testing.assert_array_equal(formats.ulp(w, "float32"), np.spacing(w.astype(np.float32)))
    # 1e6 overflows float16.
    assert formats.ulp(1e6, "float16") == np.inf


def test_update_is_lost():
    assert formats.update_is_lost(1.0, 1e-4, "float16") is True
    assert formats.update_is_lost(1.0, 1e-4, "float32") is False
    # Just above half an ulp the update survives; at exactly half an ulp it ties to even.
    assert formats.update_is_lost(1.0, 2.0**-11 * 1.01, "float16") is False
    assert formats.update_is_lost(1.0, 2.0**-11, "float16") is True
    # bfloat16 (7 mantissa bits) loses a typical Adam step of 1e-3 on a weight of 1.
    lost = formats.update_is_lost([1.0, 1.0, 0.01], [1e-3, 1e-2, 1e-3], "bfloat16")
    np.testing.assert_array_equal(lost, [True, False, False])


def test_underflows_and_round_to():
    np.testing.assert_array_equal(
        formats.underflows([1e-8, 2.0**-24, 1e-3, 0.0, -1e-9], "float16"),
        [True, False, False, False, True],
    )
    assert formats.underflows(1e-8, "bfloat16") is False
    assert formats.underflows(1e-8, "float8_e5m2") is True

    assert formats.round_to(1.0 + 2.0**-12, "float16") == 1.0
    assert formats.round_to(3.14159, "tf32") == 3.140625
    assert formats.round_to(70000.0, "float16") == np.inf
    np.testing.assert_array_equal(
        formats.round_to([0.1, 1.1], "bfloat16"),
        np.array([0.1, 1.1]).astype(ml_dtypes.bfloat16).astype(np.float64),
    )


def test_tf32_rounding_matches_mantissa_bit_rounding():
    # TF32 = float32 with the mantissa rounded to 10 bits (round half to even on bit 13),
    # over the whole float32 range including subnormals.
    rng = np.random.default_rng(0)
    x = rng.standard_normal(20000).astype(np.float32)
    x *= np.exp2(rng.integers(-140, 127, x.size)).astype(np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~np.uint64(0x1FFF)
    expected = rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    np.testing.assert_array_equal(formats.round_to(x, "tf32"), expected)
