"""A small model, its data and a save/resume check shared by the lean tests
(`test_lean.py`, `test_lean_int4.py`, `test_lean_general.py`)."""

import keras
import numpy as np

import keras_mp as kmp


def np_(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype="float32")


def mlp(width: int = 128, dtype: str = "float32", seed: int = 0):
    """16 inputs -> Dense(width, relu) -> Dense(3) logits, float32 weights by default."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(width, activation="relu", dtype=dtype)(inputs)
    outputs = keras.layers.Dense(3, dtype=dtype)(h)
    return keras.Model(inputs, outputs)


def data(n: int = 64, seed: int = 0):
    """`(x, y)`: normal inputs and 3 classes read off the signs of the first two."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def train_batches(model, x, y, first: int, last: int) -> None:
    """`train_on_batch` on batches `first` to `last - 1` of 8 samples."""
    for i in range(first, last):
        model.train_on_batch(x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8])


def train(model, opt, steps: int = 5, **compile_kwargs) -> list:
    """Compiles `model` with `opt` (sparse cross-entropy on logits), runs `steps` batches
    of `data()` and returns its trainable values (float32 numpy)."""
    x, y = data()
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    train_batches(model, x, y, 0, steps)
    return [np_(v.value) for v in model.trainable_variables]


def assert_resume_bit_identical(model, path: str, x, y):
    """Saves `model` (compiled and trained), loads it with `kmp.saving.load_model`, and
    asserts that the optimizer's variables load bit for bit and that three more steps give
    both copies the same weights and state bit for bit. Returns the loaded model."""
    model.save(path)
    loaded = kmp.saving.load_model(path)
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert a.dtype == b.dtype and a.path == b.path
        np.testing.assert_array_equal(np_(a.value), np_(b.value))
    for m in (model, loaded):
        train_batches(m, x, y, 3, 6)
    for a, b in zip(model.trainable_variables, loaded.trainable_variables):
        np.testing.assert_array_equal(np_(a.value), np_(b.value))
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np_(a.value), np_(b.value))
    return loaded
