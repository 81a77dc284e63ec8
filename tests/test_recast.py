"""numerics.recast: variables re-created in another dtype, values rounded, under `-W error`."""

import warnings

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.numerics.recast import host_value


def _model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(3, name="dense")(inputs)
    return keras.Model(inputs, keras.layers.BatchNormalization(name="bn")(h))


@pytest.mark.parametrize("policy, dtype", [("lean_bfloat16", "bfloat16"), ("float16", "float16")])
def test_conversion_recasts_under_deprecation_warnings_as_errors(policy, dtype):
    """Issue 46: NumPy 2's DeprecationWarning for `np.array(tf.Variable)` (no `copy`
    argument) came out of `recast` and failed `kmp.convert` under `python -W error`."""
    model = _model()
    kernel = np.linspace(-3, 3, 12, dtype="float32").reshape(4, 3) + 1e-3
    model.get_layer("dense").kernel.assign(kernel)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)  # float16's "no master weights"
        converted = kmp.convert(model, policy)
        got = host_value(converted.get_layer("dense").kernel)
    assert str(got.dtype) == dtype
    want = kernel.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    np.testing.assert_array_equal(got, want)  # rounded once, to nearest
    assert not np.array_equal(got.astype("float32"), kernel)  # it was rounded


def test_host_value_reads_variables_and_tensors_in_their_dtype():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        v = keras.Variable(np.array([1.5, -2.25], "float32"), dtype="bfloat16")
        assert host_value(v).dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(host_value(v).astype("float32"), [1.5, -2.25])
        t = keras.ops.convert_to_tensor(np.array([3.0], "float16"))
        assert host_value(t).dtype == np.float16 and host_value(t)[0] == 3.0
