"""Labels outside the class range into `kmp.losses.SparseCategoricalCrossentropy`: an error
naming the range and `ignore_class` where one can be raised, a NaN loss and a skipped step
under XLA (TensorFlow's `jit_compile=True` clamped the gather: a finite, wrong loss)."""

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_mp as kmp

CLASSES = 4


def _data(bad_label=7):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.integers(0, CLASSES, size=(32,))
    y[3] = bad_label
    return x, y


def _model(loss, jit_compile, optimizer="sgd"):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    return model


@pytest.mark.parametrize("from_logits", [True, False])
def test_eager_call_names_the_labels_and_ignore_class(from_logits):
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    pred = np.full((3, CLASSES), 0.25, "float32")
    with pytest.raises(ValueError, match=r"class indices in \[0, 4\).*got -1, 7.*ignore_class="):
        loss(np.array([7, 1, -1]), pred)
    # the same labels with -1 as the padding label: finite, and equal to the valid rows'
    ok = kmp.losses.SparseCategoricalCrossentropy(from_logits=from_logits, ignore_class=-1)
    with pytest.raises(ValueError, match=r"got 7 .*ignore_class=-1 are left out"):
        ok(np.array([7, 1, -1]), pred)
    value = float(ok(np.array([2, 1, -1]), pred))
    assert value == pytest.approx(np.log(4.0) * 2 / 2, rel=1e-6)


@pytest.mark.parametrize("from_logits", [True, False])
def test_out_of_range_label_under_xla_gives_nan_and_skips_the_step(from_logits):
    x, y = _data()
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(CLASSES, None if from_logits else "softmax")]
    )
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic=False, initial_scale=1.0)
    model.compile(optimizer=opt, loss=loss, jit_compile=True)
    before = [np.array(w) for w in model.get_weights()]
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert np.isnan(history.history["loss"][0])
    assert int(keras.ops.convert_to_numpy(model.optimizer.skipped_steps)) == 1
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)  # the step changed no weight


@pytest.mark.tf_only
@pytest.mark.parametrize("from_logits", [True, False])
def test_tf_graph_without_xla_fails_the_step_with_the_message(from_logits):
    import tensorflow as tf

    x, y = _data()
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    model = _model(loss, jit_compile=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"class indices in \[0, 4\)"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)


@pytest.mark.parametrize("jit_compile", [True, False])
def test_in_range_labels_ignore_class_and_masks_still_train(jit_compile):
    """-1 labels with ignore_class=-1, and -1 labels at positions the predictions' mask
    leaves out: no error, no NaN, and the loss of the valid positions only."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 9, size=(8, 5))
    ids[:, 3:] = 0  # padding, masked by the Embedding
    y = rng.integers(0, CLASSES, size=(8, 5))
    y[:, 3:] = -1
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(9, 6, mask_zero=True)(inputs)
    out = keras.layers.Dense(CLASSES)(h)
    model = keras.Model(inputs, out)
    for loss in (
        kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        kmp.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1),
    ):
        model.compile("sgd", loss, jit_compile=jit_compile)
        got = model.evaluate(ids, y, batch_size=8, verbose=0)
        logits = keras.ops.convert_to_numpy(model(ids))[:, :3]
        ref = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[:, :3], logits)
        assert got == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's jit: NaN where TensorFlow would raise")
def test_jax_jit_gives_nan_where_keras_reads_a_fill_value():
    x, y = _data(bad_label=-2)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(CLASSES, "softmax")])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(), jit_compile=True)
    assert np.isfinite(model.evaluate(x, y, batch_size=32, verbose=0))  # Keras: silent
    model.compile("sgd", kmp.losses.SparseCategoricalCrossentropy(), jit_compile=True)
    assert np.isnan(model.evaluate(x, y, batch_size=32, verbose=0))


def test_nonfinite_guard_names_the_labels_under_xla():
    x, y = _data()
    y[::8] = 7  # one in every batch
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _model(
        loss,
        jit_compile=True,
        optimizer=kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), dynamic=False, initial_scale=1.0
        ),
    )
    guard = kmp.callbacks.NonFiniteGuard(patience=2, diagnose_data=(x, y))
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[guard])
    assert guard.stopped_step in (2, 3)  # JAX reads the skip one step later
    assert "label(s) outside the class range" in guard.diagnosis
    assert "class indices in [0, 4) (the predictions have 4 classes); got 7." in guard.diagnosis
    assert "float16" not in guard.diagnosis


@pytest.mark.parametrize("jit_compile", [True, False])
def test_binary_labels_outside_0_1_are_named_or_nan(jit_compile):
    loss = kmp.losses.BinaryCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 1\].*got -1, 2.*\(y \+ 1\) / 2"):
        loss(np.array([[-1.0], [2.0], [1.0]]), np.zeros((3, 1), "float32"))
    # soft labels and label smoothing stay fine
    soft = kmp.losses.BinaryCrossentropy(from_logits=True, label_smoothing=0.1)
    assert float(soft(np.array([[0.3], [1.0]]), np.zeros((2, 1), "float32"))) == pytest.approx(
        np.log(2.0), rel=1e-6
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = np.where(rng.random((32, 1)) > 0.5, 1.0, -1.0).astype("float32")  # -1/1 labels
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic=False, initial_scale=1.0)
    model.compile(optimizer=opt, loss=loss, jit_compile=jit_compile)
    before = [np.array(w) for w in model.get_weights()]
    if jit_compile:  # XLA (TensorFlow's jit_compile, JAX's jit): NaN and a skipped step
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        assert np.isnan(history.history["loss"][0])  # Keras' own: a finite loss
        for a, b in zip(before, model.get_weights()):
            np.testing.assert_array_equal(a, b)
    else:  # a TF graph fails the step; JAX without jit sees the values: both name them
        expected = ValueError
        if BACKEND == "tensorflow":
            import tensorflow as tf

            expected = tf.errors.InvalidArgumentError
        with pytest.raises(expected, match=r"must be in \[0, 1\]"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
