"""The run check: convert runs the converted model and pins the layers that cannot run in
the compute dtype (keras_mp.conversion.runcheck)."""

import os

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.conversion import trial as _trial


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class RangeScale(keras.layers.Layer):
    """Multiplies by positions built with `arange` in the compute dtype, as keras_hub's
    ESMRotaryEmbedding does: TensorFlow has no float16 `Range` kernel in a graph."""

    def call(self, x):
        positions = keras.ops.arange(0, x.shape[-1], dtype=self.compute_dtype)
        return x * (1.0 + positions / 100.0)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class Block(keras.layers.Layer):
    """A block with its own math around a sublayer that fails in float16."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="dense", dtype=self.dtype_policy)
        self.scale = RangeScale(name="scale", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.dense.build(input_shape)
        self.scale.build((None, 8))

    def call(self, x):
        return x + keras.ops.cast(self.scale(self.dense(x)), x.dtype)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class Tiny(keras.Model):
    """A Functional model that builds its own layers, as keras_hub's backbones do: its
    config saves its dtype (on conversion, the plan's `DTypePolicyMap`), which every layer
    gets and resolves by its path."""

    def __init__(self, dtype=None, **kwargs):
        inputs = keras.Input((8,))
        h = keras.layers.Dense(8, name="embed", dtype=dtype)(inputs)
        h = Block(name="block_0", dtype=dtype)(h)
        h = Block(name="block_1", dtype=dtype)(h)
        outputs = keras.layers.Dense(4, name="head", dtype=dtype)(h)
        super().__init__(inputs, outputs, dtype=dtype, **kwargs)

    def get_config(self):
        return {"name": self.name, "trainable": self.trainable,
                "dtype": keras.dtype_policies.serialize(self.dtype_policy)}


def _model():
    return Tiny()


X = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")


@pytest.mark.tf_only  # JAX has float16 arange
def test_layer_without_a_float16_kernel_is_pinned_alone_and_the_model_runs(tmp_path):
    model = _model()
    reference = keras.ops.convert_to_numpy(model(X))
    unchecked = kmp.convert(model, "mixed_float16", check=None)
    with pytest.raises(Exception, match="(?i)range|dtype"):
        unchecked.predict_on_batch(X)

    converted = kmp.convert(model, "mixed_float16")
    plan = converted.precision_plan
    assert [p.path for p in plan.pins] == ["block_0/scale", "block_1/scale"]
    assert all(p.reason.startswith("run check: ") for p in plan.pins)
    assert plan.check.checked and plan.check.inputs == "made from model.inputs"
    assert plan.check.fp32_flops == 0.0  # the pinned layers have no matmul
    # Only the failing layer runs in float32: the block's dense and own math stay float16.
    assert converted.get_layer("block_0").dense.compute_dtype == "float16"
    assert converted.get_layer("block_0").compute_dtype == "float16"
    assert converted.get_layer("block_0").scale.compute_dtype == "float32"
    got = keras.ops.convert_to_numpy(keras.ops.cast(converted.predict_on_batch(X), "float32"))
    assert np.abs(got - reference).max() / np.abs(reference).max() < 1e-2
    assert "run check (forward, made from model.inputs): 2 layer(s) pinned" in str(plan)

    path = os.path.join(tmp_path, "m.keras")
    converted.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("block_1").scale.compute_dtype == "float32"
    assert loaded.get_layer("block_1").dense.compute_dtype == "float16"
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(keras.ops.cast(loaded.predict_on_batch(X), "float32")),
        got, atol=1e-6)


@pytest.mark.tf_only
def test_audit_names_the_layer_that_cannot_run_and_the_fix():
    unchecked = kmp.convert(_model(), "mixed_float16", check=None)
    report = kmp.audit(unchecked, X)  # the audit's own probes run eagerly, and finish
    note = next(n for n in report.notes if n.startswith("run check"))
    assert "layer 'block_0/scale'" in note and "check='auto'" in note
    checked = kmp.convert(_model(), "mixed_float16")
    assert not any(n.startswith("run check") for n in kmp.audit(checked, X).notes)


def test_check_argument_is_validated():
    with pytest.raises(ValueError, match="`check` must be one of"):
        kmp.convert(_model(), "mixed_float16", check="backward")


def test_models_that_run_get_no_pin_and_a_report():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    plan = kmp.convert(model, "mixed_bfloat16").precision_plan
    assert plan.check.checked and not plan.check.pinned
    assert plan.to_dict()["check"]["mode"] == "forward"


def test_sample_inputs_follow_the_input_specs():
    ids = keras.Input((None,), dtype="int32", name="ids")
    image = keras.Input((None, None, 3), name="image")
    tokens = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 3)(ids))
    pixels = keras.layers.GlobalAveragePooling2D()(image)
    # both inputs reach the output (Keras 3.12 refuses a Functional model with an unused one)
    model = keras.Model({"ids": ids, "image": image},
                        keras.layers.Dense(2)(keras.layers.Concatenate()([tokens, pixels])))
    x = _trial.sample_inputs(model)
    assert x["ids"].shape == (2, 8) and x["ids"].dtype == np.int32 and (x["ids"] == 1).all()
    assert x["image"].shape == (2, 64, 64, 3) and x["image"].dtype == np.float32


@pytest.mark.tf_only
def test_failure_that_pinning_cannot_fix_names_the_layer_and_the_option():
    @keras.saving.register_keras_serializable(package="keras_mp_tests")
    class AlwaysFails(keras.layers.Layer):
        def call(self, x):
            if self.compute_dtype == "float16" or x.dtype == "float16":
                raise ValueError("no float16 here")
            return x

    inputs = keras.Input((8,))
    h = keras.layers.Dense(8, name="embed")(inputs)
    model = keras.Model(inputs, AlwaysFails(name="picky")(h))
    # Pinned, the layer gets float32 inputs (Keras casts them) and runs: no error.
    assert [p.path for p in kmp.convert(model, "mixed_float16").precision_plan.pins] == ["picky"]


def _upsampler():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv")(inputs)
    h = keras.layers.UpSampling2D(2, interpolation="bilinear", name="up")(h)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu", name="conv2")(h)
    return keras.Model(inputs, keras.layers.Conv2D(1, 1, name="head")(h))


@pytest.mark.tf_only  # TensorFlow's XLA has no float16 ResizeBilinearGrad next to a ReLU
def test_bilinear_resize_whose_xla_gradient_fails_is_pinned_and_the_model_trains():
    model = _upsampler()
    images = np.random.default_rng(0).uniform(size=(2, 8, 8, 3)).astype("float32")
    targets = np.zeros((2, 16, 16, 1), "float32")
    forward_only = kmp.convert(model, "mixed_float16", check="forward")
    assert not forward_only.precision_plan.pins
    assert any("['up'] resize in float16" in n and "check='train'" in n
               for n in forward_only.precision_plan.notes)

    converted = kmp.convert(model, "mixed_float16")  # "auto": a gradient step, as it resizes
    plan = converted.precision_plan
    assert plan.check.mode == "train"
    assert [p.path for p in plan.pins] == ["up"]
    assert plan.pins[0].reason.startswith("run check: gradient step fails in float16")
    assert "Seen floating point types of different precisions" in plan.pins[0].reason
    assert converted.get_layer("conv2").compute_dtype == "float16"
    converted.compile(optimizer="adam", loss="mse", jit_compile=True)
    assert np.isfinite(converted.train_on_batch(images, targets))


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA refuses a traced program")
def test_a_program_xla_refuses_whole_is_located_by_its_trace_and_pinned():
    """Harness fresh probe, JAX seed 231: on JAX's CPU, `MultiHeadAttention` under
    mixed_float16 compiles to a float16 dot with float32 accumulation that XLA's CPU backend
    refuses ("The precision 'F16_F16_F32' is not supported by dot_general") after every
    layer's call returned. convert named the whole model and told the user to pin it; the
    op's trace-time stack names the layer: it is pinned and the model converts and runs."""
    keras.utils.set_random_seed(0)
    i = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(20, 16)(i)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="mha")(h, h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Add()([h, a]))
    model = keras.Model(i, keras.layers.Dense(3)(h))
    x = np.random.default_rng(0).integers(0, 20, size=(4, 8)).astype("int32")
    unchecked = kmp.convert(model, "mixed_float16", check=None)
    refused = _trial.forward_failure(unchecked, x)
    converted = kmp.convert(model, "mixed_float16")
    out = converted.predict(x, verbose=0)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, model.predict(x, verbose=0), atol=2e-2)
    if refused is not None:  # jaxlib 0.10's CPU backend: the layer is named, then pinned
        assert refused.address == "mha" and "dot_general" in refused.error
        assert converted.get_layer("mha").compute_dtype == "float32"
