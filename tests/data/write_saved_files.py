"""Writes the `.keras` files that tests/test_saved_release.py loads, with today's keras_mp.

Run it from the repository root with the code whose files should stay loadable (it was run
once before the package regroup, issue 53, to write tests/data/pre_regroup/):

    KERAS_BACKEND=tensorflow python tests/data/write_saved_files.py tests/data/pre_regroup

A small attention model is converted to `mixed_float16` (compiled with
kmp.LossScaleOptimizer and a kmp loss) and to `lean_bfloat16` (compiled with "adamw", which
becomes kmp.LeanOptimizer), trained two epochs and saved; expected.json keeps the
predictions, the dtype policy per layer and the small optimizer variables.
"""

import json
import os
import sys

import keras
import numpy as np

import keras_mp as kmp


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6, 8)).astype("float32")
    y = rng.integers(0, 5, size=(16, 6)).astype("int32")
    return x, y


def _model():
    inputs = keras.Input((6, 8))
    h = keras.layers.Dense(16)(inputs)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)(h, h)
    h = keras.layers.Dense(16, activation="gelu")(h)
    return keras.Model(inputs, keras.layers.Dense(5)(h))


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    keras.utils.set_random_seed(0)
    x, y = _batch()
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = {
        "keras": keras.__version__,
        "keras_mp": kmp.__version__,
        "backend": keras.backend.backend(),
        "models": {},
    }
    for policy in ("mixed_float16", "lean_bfloat16"):
        model = kmp.convert(_model(), policy)
        if policy == "mixed_float16":
            optimizer = kmp.LossScaleOptimizer(keras.optimizers.AdamW(1e-3))
        else:
            optimizer = "adamw"
        model.compile(optimizer=optimizer, loss=loss)
        model.fit(x, y, epochs=2, batch_size=8, verbose=0)
        model.save(os.path.join(out, f"{policy}.keras"))
        small = {
            v.path: np.asarray(keras.ops.convert_to_numpy(v), "float64").tolist()
            for v in model.optimizer.variables
            if int(np.prod(v.shape)) <= 4
        }
        expected["models"][policy] = {
            "optimizer": type(model.optimizer).__name__,
            "prediction": np.asarray(model.predict(x[:2], verbose=0), "float64").tolist(),
            "dtype_policies": {layer.name: layer.dtype_policy.name for layer in model.layers},
            "small_optimizer_variables": small,
        }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
