"""Keras' own policy names with keras_mp imported: nothing silently wrong (issue 47.1-2).

Users arrive with Keras' spelling, `keras.mixed_precision.set_global_policy(...)`:

- a `train_step` that never calls `scale_loss` (keras.io's knowledge distillation) under
  Keras' `"mixed_float16"` used to keep Keras' own scaler, which divided every gradient by
  32768; it now gets `kmp.LossScaleOptimizer`, which applies unscaled gradients as they
  are (with a warning), as under `kmp.set_global_policy`;
- a model's own optimizer applied in its `train_step` (SimCLR's) on float16-computing
  weights warns naming `kmp.LossScaleOptimizer`, whichever call set the policy.

Tiny models on random data: seconds each (TensorFlow: JAX's CPU has no float16 dot).
"""

import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp

pytestmark = pytest.mark.tf_only


def _set_policy(how: str, name: str) -> None:
    if how == "keras":
        keras.mixed_precision.set_global_policy(name)
    else:
        kmp.set_global_policy(name)


def _mlp(name: str) -> keras.Model:
    return keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)],
        name=name,
    )


class Distiller(keras.Model):
    """keras.io's "Knowledge Distillation" `train_step`: its loss is never scaled."""

    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher

    def call(self, x):
        return self.student(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        teacher = tf.nn.softmax(tf.cast(self.teacher(x, training=False), "float32") / 2.0)
        with tf.GradientTape() as tape:
            logits = tf.cast(self.student(x, training=True), "float32")
            student_loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            )
            distill = tf.reduce_mean(
                keras.losses.kl_divergence(teacher, tf.nn.softmax(logits / 2.0))
            )
            loss = 0.1 * student_loss + 0.9 * distill
        variables = self.student.trainable_variables
        grads = tape.gradient(loss, variables)
        self.optimizer.apply_gradients(zip(grads, variables))
        return {"loss": loss}


def _distiller_step(policy_how: str | None):
    """The student's kernel movement over one SGD(0.5) step, and the warnings."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype("float32")
    y = rng.integers(0, 4, 32).astype("int32")
    keras.utils.set_random_seed(1)
    teacher, student = _mlp("teacher"), _mlp("student")
    if policy_how is not None:
        _set_policy(policy_how, "mixed_float16")
    distiller = Distiller(student, teacher)
    distiller(x[:1])
    # the same starting weights under every policy
    keras.utils.set_random_seed(1)
    reference_teacher, reference_student = _mlp("t"), _mlp("s")
    teacher.set_weights(reference_teacher.get_weights())
    student.set_weights(reference_student.get_weights())
    distiller.compile(optimizer=keras.optimizers.SGD(0.5))
    before = keras.ops.convert_to_numpy(student.layers[0].kernel.value).copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distiller.fit(x, y, batch_size=32, epochs=1, verbose=0)
    after = keras.ops.convert_to_numpy(student.layers[0].kernel.value)
    return distiller, np.abs(after - before).max(), [str(w.message) for w in caught]


@pytest.mark.parametrize("how", ["keras", "kmp"])
def test_unscaled_train_step_under_float16_moves_as_in_float32(how):
    _, reference, _ = _distiller_step(None)
    keras.config.set_dtype_policy("float32")
    distiller, moved, messages = _distiller_step(how)
    assert type(distiller.optimizer) is kmp.LossScaleOptimizer  # not Keras' unbounded one
    assert reference > 1e-3
    assert 0.8 < moved / reference < 1.25, (moved, reference)  # was 1/32768 of it
    assert any("the loss was never scaled" in m for m in messages)


class OwnOptimizerModel(keras.Model):
    """SimCLR's pattern: `compile()` without an optimizer, its own Adam in `train_step`."""

    def __init__(self):
        super().__init__()
        self.encoder = _mlp("encoder")
        self.own_optimizer = keras.optimizers.Adam(1e-3)

    def call(self, x):
        return self.encoder(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            logits = tf.cast(self.encoder(x, training=True), "float32")
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            )
        variables = self.encoder.trainable_variables
        self.own_optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return {"loss": loss}


@pytest.mark.parametrize("how", ["keras", "kmp"])
def test_own_optimizer_on_float16_weights_warns_naming_the_scaler(how):
    _set_policy(how, "mixed_float16")
    model = OwnOptimizerModel()
    model.compile()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16)).astype("float32")
    y = rng.integers(0, 4, 16).astype("int32")
    with pytest.warns(UserWarning, match=r"kmp\.LossScaleOptimizer\(keras\.optimizers\.Adam"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_own_optimizer_under_float32_says_nothing():
    model = OwnOptimizerModel()
    model.compile()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 16)).astype("float32")
    y = rng.integers(0, 4, 16).astype("int32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
