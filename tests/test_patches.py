"""keras_glue.patches: what `import keras_mp` changes in Keras, `KERAS_MP_NO_PATCH`, uninstall."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp import patches

ROOT = Path(__file__).resolve().parents[1]


def _compiled(policy="mixed_float16"):
    inputs = keras.Input((4,))
    model = kmp.convert(keras.Model(inputs, keras.layers.Dense(3)(inputs)), policy)
    model.compile(optimizer="adam", loss="mse")
    return model


def test_uninstall_gives_keras_its_compile_and_apply_back():
    assert patches.installed()["compile"] and patches.installed()["optimizer_apply"]
    assert type(_compiled().optimizer) is kmp.LossScaleOptimizer
    patches.uninstall()
    try:
        assert not patches.installed()["compile"] and not patches.installed()["optimizer_apply"]
        model = _compiled()
        assert type(model.optimizer) is keras.optimizers.Adam  # Keras' own compile
        before = [np.asarray(v) for v in model.get_weights()]
        model.fit(np.ones((8, 4), "float32"), np.zeros((8, 3), "float32"), verbose=0)
        assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        patches.uninstall()  # idempotent
    finally:
        patches.install()
    assert patches.installed()["compile"] and patches.installed()["optimizer_apply"]
    assert type(_compiled().optimizer) is kmp.LossScaleOptimizer


def test_disabled_reads_the_variable():
    assert not patches.disabled({})
    assert patches.disabled({"KERAS_MP_NO_PATCH": "1"})
    assert patches.disabled({"KERAS_MP_NO_PATCH": "true"})
    assert not patches.disabled({"KERAS_MP_NO_PATCH": "0"})


_IMPORT = """
import json, os
import keras_mp as kmp
import keras
inputs = keras.Input((4,))
model = kmp.convert(keras.Model(inputs, keras.layers.Dense(3)(inputs)), "mixed_float16")
model.compile(optimizer="adam", loss="mse")
print(json.dumps({
    "level": os.environ.get("TF_CPP_MIN_LOG_LEVEL"),
    "installed": kmp.patches.installed(),
    "optimizer": type(model.optimizer).__name__,
}))
"""


def _import_keras_mp(**env):
    base = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, "KERAS_BACKEND": "tensorflow", "PYTHONPATH": str(ROOT), **env},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.tf_only
def test_import_hides_tensorflow_info_lines_unless_the_user_chose_a_level():
    """Issue 46: library use printed TensorFlow's C++ INFO lines the CLI hides."""
    out, stderr = _import_keras_mp()
    assert out["level"] == "1"  # set for TensorFlow, which keras_mp imported first
    # INFO lines (some written before TensorFlow reads the level: filtered while it loads),
    # absl's banner and "no CUDA GPU here" are gone; other stderr output is kept
    assert "I0000" not in stderr and "absl::InitializeLog" not in stderr, stderr
    assert "failed call to cuInit" not in stderr
    assert out["installed"] == {
        "compile": True,
        "optimizer_apply": True,
        "collective_broadcasts": True,
        "clone_model": True,
        "sublayer_dtypes": True,
        "user_pins": True,
        "normalization_adapt": True,
        "added_losses": True,
        "fit_guard": True,
        "orthogonal_float32": True,
    }
    assert out["optimizer"] == "LossScaleOptimizer"


@pytest.mark.tf_only
def test_keras_mp_no_patch_changes_nothing():
    out, stderr = _import_keras_mp(KERAS_MP_NO_PATCH="1")
    assert "I0000" in stderr  # TensorFlow's INFO lines as without keras_mp
    assert out["installed"] == {
        "compile": False,
        "optimizer_apply": False,
        "collective_broadcasts": False,
        "clone_model": False,
        "sublayer_dtypes": False,
        "user_pins": False,
        "normalization_adapt": False,
        "added_losses": False,
        "fit_guard": False,
        "orthogonal_float32": False,
    }
    assert out["optimizer"] == "Adam"  # Keras' compile: pass kmp.LossScaleOptimizer yourself


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_orthogonal_weights_in_low_precision_are_drawn_in_float32(dtype):
    """Harness finding H10: an LSTM under Keras' pure "float16" on JAX could not be built
    (jaxlib's QR has no float16; no backend has a bfloat16 one). The matrix is drawn in
    float32 and cast: the float32 draw's values, rounded."""
    init = keras.initializers.Orthogonal(seed=3)
    low = keras.ops.convert_to_numpy(keras.ops.cast(init((16, 16), dtype=dtype), "float32"))
    exact = keras.ops.convert_to_numpy(keras.initializers.Orthogonal(seed=3)((16, 16)))
    step = {"float16": 2**-11, "bfloat16": 2**-8}[dtype]  # half a unit in the last place
    np.testing.assert_allclose(low, exact, rtol=step, atol=0)
    np.testing.assert_allclose(low.T @ low, np.eye(16), atol=20 * step)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(dtype)
    try:
        lstm = keras.layers.LSTM(4)
        lstm(np.zeros((2, 5, 3), dtype))
    finally:
        keras.config.set_dtype_policy(previous)
    assert lstm.cell.recurrent_kernel.dtype == dtype
