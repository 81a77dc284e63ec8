"""Compiling under a keras_mp policy gives keras_mp's loss scaler (keras_mp.scaling.autoscale)."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp

# JAX on CPU has no float16 dot: these tests compile and inspect, and train on TF only.


def _model(name="m"):
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(x), name=name)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", keras.optimizers.AdamW(1e-3)])
def test_global_keras_mp_policy_compile_gets_keras_mp_scaler(optimizer):
    kmp.set_global_policy("mixed_float16")
    model = _model()
    model.compile(optimizer=optimizer, loss="mse")
    opt = model.optimizer
    assert type(opt) is kmp.LossScaleOptimizer
    assert not isinstance(opt.inner_optimizer, keras.optimizers.LossScaleOptimizer)
    if not isinstance(optimizer, str):
        assert opt.inner_optimizer is optimizer
    assert opt.initial_scale == 2.0**15 and opt.max_scale == 2.0**24  # keras_mp's bounds


def test_converted_model_compile_gets_keras_mp_scaler_and_keras_would_not_scale_at_all():
    converted = kmp.convert(_model(), "mixed_float16")
    assert converted.dtype_policy.name == "map_mixed_float16"  # Keras' auto-wrap skips this
    converted.compile(optimizer="adam", loss="mse")
    assert type(converted.optimizer) is kmp.LossScaleOptimizer
    # An explicit keras_mp scaler is kept as given.
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8.0)
    converted.compile(optimizer=opt, loss="mse")
    assert converted.optimizer is opt


def test_loaded_converted_model_is_scaled(tmp_path):
    """A loaded Functional model keeps per-layer float16 policies, its own policy is
    float32: Keras would compile it without any loss scaling."""
    path = str(tmp_path / "m.keras")
    kmp.convert(_model(), "mixed_float16").save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("hidden").compute_dtype == "float16"
    loaded.compile(optimizer="adam", loss="mse")
    assert type(loaded.optimizer) is kmp.LossScaleOptimizer


def test_explicit_stock_scaler_is_kept_with_a_warning():
    converted = kmp.convert(_model(), "mixed_float16")
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    with pytest.warns(UserWarning, match="Keras' own LossScaleOptimizer.*no bounds"):
        converted.compile(optimizer=stock, loss="mse")
    assert converted.optimizer is stock
    with pytest.warns(UserWarning, match="Keras' own LossScaleOptimizer"):
        kmp.convert(converted, "mixed_float16")  # convert says so too


class _GuideStep(keras.Model):
    """keras.io's "Customizing fit()" train_step: the loss is never scaled."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


class _ScaledStep(_GuideStep):
    def train_step(self, data):  # the same, scaling as Keras' scaler needs
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.tf_only
def test_own_train_step_without_scale_loss_under_the_stock_scaler_is_named():
    """The harness' H11/seed 200: Keras' scaler divides an unscaled train_step's gradients
    by 32768 and the run stalls with a finite loss; the warning says so and names the fix
    (the generic "no bounds" warning did not)."""
    x, y = np.ones((8, 6), "float32"), np.zeros((8, 3), "float32")
    for cls, says in ((_GuideStep, True), (_ScaledStep, False)):
        inputs = keras.Input((6,))
        model = cls(inputs, keras.layers.Dense(3)(inputs), name="guide")
        model = kmp.convert(model, "mixed_float16")
        assert type(model) is cls
        stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model.compile(optimizer=stock, loss="mse")
        text = " ".join(str(w.message) for w in seen)
        assert ("never calls `self.optimizer.scale_loss(loss)`" in text) is says, text
        assert ("32768 times too small" in text) is says
        before = model.get_weights()[0].copy()
        model.fit(x, y, epochs=1, verbose=0)
        moved = float(np.abs(model.get_weights()[0] - before).max())
        # the warning is true: unscaled, the step is 32768x smaller than the scaled one
        assert (moved < 1e-4) is says, moved


def test_plain_keras_policy_auto_scale_off_and_bfloat16():
    keras.config.set_dtype_policy("mixed_float16")  # no keras_mp policy in sight
    plain = _model()
    plain.compile(optimizer="adam", loss="mse")
    assert type(plain.optimizer) is keras.optimizers.LossScaleOptimizer  # Keras' own
    # (a model with its own train_step gets keras_mp's: tests/integration/test_keras_spelling)
    converted = kmp.convert(_model("n"), "mixed_float16")
    converted.compile(optimizer="adam", loss="mse", auto_scale_loss=False)
    assert type(converted.optimizer) is keras.optimizers.Adam
    keras.config.set_dtype_policy("float32")
    bf16 = kmp.convert(_model("o"), "mixed_bfloat16")
    bf16.compile(optimizer="adam", loss="mse")
    assert type(bf16.optimizer) is kmp.LossScaleOptimizer  # skips, scales nothing
    assert bf16.optimizer.skip_only
    assert type(bf16.optimizer.inner_optimizer) is keras.optimizers.Adam


@pytest.mark.tf_only
def test_keras_way_trains_with_the_bounded_scaler_and_skips_a_nan_batch():
    kmp.set_global_policy("mixed_float16")
    model = _model()
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 6)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    before = [keras.ops.convert_to_numpy(w.value).copy() for w in model.weights]
    x_bad = x.copy()
    x_bad[0, 0] = np.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x_bad[:16], y[:16], batch_size=16, epochs=1, verbose=0)
    opt = model.optimizer
    assert int(keras.ops.convert_to_numpy(opt.skipped_steps.value)) == 1
    assert float(keras.ops.convert_to_numpy(opt.loss_scale.value)) == 2.0**14  # 2**15 halved
    for a, w in zip(before, model.weights, strict=True):  # the NaN step changed nothing
        np.testing.assert_array_equal(a, keras.ops.convert_to_numpy(w.value))


@pytest.mark.tf_only
def test_audit_and_callbacks_say_when_the_stock_scaler_is_used():
    converted = kmp.convert(_model(), "mixed_float16")
    with pytest.warns(UserWarning):
        converted.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse"
        )
    x = np.ones((8, 6), "float32")
    report = kmp.audit(converted, x)
    assert any("Keras' own LossScaleOptimizer" in note for note in report.notes)
    with pytest.warns(UserWarning, match="LossScaleMonitor: Model .* Keras' own"):
        converted.fit(x, np.ones((8, 3), "float32"), epochs=1, verbose=0,
                      callbacks=[kmp.callbacks.LossScaleMonitor()])


def test_converted_keras_hub_task_is_compiled_like_the_original_with_keras_mp_scaler():
    """keras_hub tasks compile themselves (a custom `compile`, which Keras'
    `compile_from_config` gives up on); the converted copy is compiled the same way."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=32, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16,
        max_sequence_length=8,
    )
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    assert task.compiled
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "compile() was not called"
        converted = kmp.convert(task, "mixed_float16")
    assert converted.compiled and type(converted.optimizer) is kmp.LossScaleOptimizer
    assert type(converted.optimizer.inner_optimizer) is type(task.optimizer)
    assert converted.optimizer.inner_optimizer is not task.optimizer
    assert converted.get_compile_config() == task.get_compile_config()
