"""`.keras` files written by earlier code load: the 0.1.0 release and main before issue 53.

The files in tests/data/release_0_1_0/ were written by keras_mp 0.1.0 on TensorFlow (Keras
3.15.1): a small attention model converted to `mixed_float16` (kmp.LossScaleOptimizer) and
to `lean_bfloat16` (kmp.LeanOptimizer), each trained two epochs, then saved. Those in
tests/data/pre_regroup/ were written the same way (tests/data/write_saved_files.py) by main
just before the package regroup (issue 53), with kmp losses and today's lean defaults. Their
configs name the old modules (`keras_mp.loss_scale`, `keras_mp.layers`, `keras_mp.losses`,
`keras_mp.lean`, ...); loading must find every class by its registered name, give the same
predictions, the same dtype policy per layer and the same optimizer state, and train on.
"""

import json
import os

import keras
import numpy as np
import pytest

import keras_mp as kmp

DATA = os.path.join(os.path.dirname(__file__), "data")
RELEASES = ("release_0_1_0", "pre_regroup")


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6, 8)).astype("float32")
    y = rng.integers(0, 5, size=(16, 6)).astype("int32")
    return x, y


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("policy", ["mixed_float16", "lean_bfloat16"])
@pytest.mark.parametrize("loader", [keras.saving.load_model, kmp.saving.load_model])
def test_previous_release_file_loads_and_trains_on(release, policy, loader):
    import inspect

    if "quantization_config" not in inspect.signature(keras.layers.Dense.__init__).parameters:
        pytest.skip(
            "these files were written by Keras 3.15.1, whose Dense config carries "
            f"`quantization_config`; Keras {keras.__version__}'s Dense rejects it (Keras "
            "does not load files written by a newer Keras)"
        )
    with open(os.path.join(DATA, release, "expected.json")) as f:
        want = json.load(f)["models"][policy]
    model = loader(os.path.join(DATA, release, f"{policy}.keras"))
    x, y = _batch()

    assert type(model.optimizer).__name__ == want["optimizer"]
    assert {layer.name: layer.dtype_policy.name for layer in model.layers} == want["dtype_policies"]
    # bfloat16 keeps 8 significant bits, and CPUs with and without native bfloat16 dot
    # instructions round its intermediates differently (0.019 apart at most, seen between an
    # AVX512-BF16 and an AVX2-only CPU on this file).
    atol = 0.03 if policy == "lean_bfloat16" else 0.01
    np.testing.assert_allclose(
        model.predict(x[:2], verbose=0), np.asarray(want["prediction"]), rtol=0.02, atol=atol
    )
    saved = want["small_optimizer_variables"]
    state = {
        v.path: np.asarray(keras.ops.convert_to_numpy(v), "float64")
        for v in model.optimizer.variables
    }
    assert saved and set(saved) <= set(state)
    for path, value in saved.items():
        np.testing.assert_array_equal(state[path], np.asarray(value), err_msg=path)

    before = [np.array(w) for w in model.get_weights()]
    history = model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
