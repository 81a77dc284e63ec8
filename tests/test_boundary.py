"""A layer pinned alone: its low sublayers hand it float32 (keras_mp.conversion.boundary).
The loaded keras_hub case is tests/test_calibrate.py's T5Gemma test."""

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.conversion.boundary import casts_to


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class MaskedBlock(keras.layers.Layer):
    """T5Gemma's pattern: a mask made in the block's dtype as `(1 - mask) * -1e9` (0 * -inf,
    NaN in float16) and a residual add of a sublayer's output with Python's `+`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(16, name="proj", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.proj.build(input_shape)

    def call(self, x):
        bias = (1.0 - keras.ops.ones_like(x)) * -1e9
        return x + self.proj(x) + bias


def _model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 16))
    h = keras.layers.Dense(16, name="embed")(inputs)
    h = MaskedBlock(name="block")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(h))


def _f32(t):
    return keras.ops.convert_to_numpy(keras.ops.cast(t, "float32"))


@pytest.mark.tf_only  # JAX's CPU has no float16 dot
def test_block_pinned_alone_gets_float32_from_its_low_sublayer():
    model = _model()
    x = np.random.default_rng(0).normal(size=(4, 8, 16)).astype("float32")
    reference = _f32(model(x))
    assert not np.isfinite(_f32(kmp.convert(model, "mixed_float16", check=None)(x))).all()
    converted = kmp.convert(model, "mixed_float16", calibrate=x)
    plan = converted.precision_plan
    assert [(p.path, p.note) for p in plan.pins] == [("block", "its own math only")]
    block = converted.get_layer("block")
    assert (block.compute_dtype, block.proj.compute_dtype) == ("float32", "float16")
    assert casts_to(block.proj) == "float32" and casts_to(block) is None
    assert plan.calibration.fp32_flops == 0.0  # the projection's matmul stays float16
    result = _f32(converted(x))
    assert np.abs(result - reference).max() / np.abs(reference).max() < 1e-2
    # Without the cast the block's own `+` meets a float32 and a float16 tensor.
    object.__delattr__(block.proj, "call")
    with pytest.raises(Exception, match="float|half"):
        converted(x)


@pytest.mark.tf_only
def test_copies_and_reconversions_rebind_the_cast_to_their_own_layer():
    model = _model()
    x = np.random.default_rng(0).normal(size=(4, 8, 16)).astype("float32")
    converted = kmp.convert(model, "mixed_float16", calibrate=x)
    again = kmp.convert(converted, converted.precision_plan)  # a copy of the converted model
    proj, copied = converted.get_layer("block").proj, again.get_layer("block").proj
    assert copied is not proj and vars(copied)["call"].__self__ is copied
    assert casts_to(copied) == "float32"
    assert np.array_equal(_f32(again(x)), _f32(converted(x)))
    # Converted back to float32, nothing is cast.
    plain = kmp.convert(converted, "float32")
    assert casts_to(plain.get_layer("block").proj) is None
