"""Keras' own warnings show once per process under keras_mp, as under stock Keras."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.keras_glue.quiet import ignoring


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


_PLAIN_KERAS = r"""
import json, os, sys, warnings
shown = []
warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message)[:60])
if sys.argv[1] == "with":
    import keras_mp  # noqa: F401
import keras
import numpy as np
import tensorflow as tf

keras.utils.set_random_seed(0)
keras.config.set_dtype_policy("mixed_float16")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="gelu"),
                          keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
x = np.linspace(-2, 2, 64, dtype="float32").reshape(8, 8)
data = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(4)
losses = [model.fit(data, epochs=1, verbose=0, shuffle=True).history["loss"][0]
          for _ in range(2)]
print(json.dumps({"optimizer": type(model.optimizer).__module__ + type(model.optimizer).__name__,
                  "losses": losses, "out": np.asarray(model(x), "float32").tolist(),
                  "shown": shown, "policy": keras.config.dtype_policy().name}))
"""


@pytest.mark.tf_only
def test_importing_keras_mp_leaves_plain_keras_code_as_it_was():
    # Code that does not use keras_mp computes, warns and wraps exactly as without it.
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"}
    runs = {}
    for mode in ("without", "with"):
        done = subprocess.run([sys.executable, "-c", _PLAIN_KERAS, mode], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    # The one word keras_mp adds (issue 52): under Keras' own mixed policy the model's
    # outputs are float16, which a softmax sampled on the host does not sum to 1 in
    added = [w for w in runs["with"]["shown"] if w not in runs["without"]["shown"]]
    assert added == ["Model 'sequential' returns float16 outputs (Keras' own 'mixe"], added
    runs["with"]["shown"] = [w for w in runs["with"]["shown"] if w not in added]
    assert runs["with"] == runs["without"]  # computes, wraps and otherwise warns the same
    assert runs["with"]["optimizer"].endswith("LossScaleOptimizer")  # Keras' own wrapping
    assert "keras_mp" not in runs["with"]["optimizer"]
