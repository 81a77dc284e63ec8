"""Keras' own warnings show once per process under keras_mp, as under stock Keras."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp._quiet import ignoring


def _warn(text):
    warnings.warn(text, UserWarning, stacklevel=1)  # one location, as a Keras warning has


def test_ignoring_keeps_the_record_of_warnings_already_shown():
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        _warn("shown once")
        with ignoring(UserWarning):
            _warn("dropped")
            _warn("shown once")
        _warn("shown once")
        _warn("dropped")  # ignored inside the block, so not recorded: shown now
        with warnings.catch_warnings():  # what `ignoring` avoids: the record is cleared
            pass
        _warn("shown once")
    assert [str(w.message) for w in shown] == ["shown once", "dropped", "shown once"]
    assert not any(f[0] == "ignore" and f[2] is UserWarning for f in warnings.filters[:1])


def _model():
    inputs = {"a": keras.Input((8,), name="a")}
    hidden = keras.layers.Dense(16, activation="gelu")(inputs["a"])
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


@pytest.mark.tf_only
def test_converting_between_fits_does_not_repeat_keras_warnings():
    # Fit in float32, convert to both mixed policies and fit again: Keras warns about the
    # ignored `shuffle` and the input structure once in the process, not once per fit.
    import tensorflow as tf

    x, y = np.ones((16, 8), "float32"), np.ones((16, 1), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        model = _model()
        for policy in (None, "mixed_float16", "mixed_bfloat16"):
            trained = model if policy is None else kmp.convert(model, policy)
            trained.compile(optimizer="adam", loss="mse")
            trained.fit(data, epochs=1, verbose=0, shuffle=True)
            kmp.global_policy()
    texts = [str(w.message) for w in shown]
    assert sum("`shuffle=True` was passed" in t for t in texts) <= 1, texts  # Keras 3.12: 0
    assert sum("structure of `inputs` doesn't match" in t for t in texts) == 1, texts
