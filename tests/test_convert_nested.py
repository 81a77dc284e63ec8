"""kmp.convert on nested models: what sub-models report, and containers never called."""

import keras
import numpy as np
import pytest

import keras_mp as kmp


def _encoder(name: str) -> keras.Model:
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="gelu", name=f"{name}_hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name=f"{name}_proj")(hidden), name=name)


class Siamese(keras.Model):
    """A subclassed container of two built encoders and a built head, never called itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.left = _encoder("left")
        self.right = _encoder("right")
        self.head = keras.layers.Dense(1, name="head")
        self.head.build((None, 4))

    def call(self, pair):
        a, b = pair
        return self.head(keras.ops.abs(self.left(a) - self.right(b)))


def _reported(model: keras.Model) -> dict:
    return {
        x.name: (x.compute_dtype, x.dtype_policy.compute_dtype)
        for x in model._flatten_layers(include_self=True)
        if not isinstance(x, keras.layers.InputLayer)
    }


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_nested_model_reports_the_dtype_its_layers_compute_in(policy):
    low = policy.removeprefix("mixed_")
    inner = _encoder("inner")
    inputs = keras.Input((8,))
    outer = keras.Model(inputs, keras.layers.Dense(3, name="top")(inner(inputs)), name="outer")
    mixed = kmp.convert(outer, policy)
    # Every layer computes in the low dtype (no pins: no softmax, norm or softmax head).
    assert mixed.precision_plan.float32 == set()
    assert _reported(mixed) == {
        name: (low, low) for name in ("outer", "inner", "inner_hidden", "inner_proj", "top")
    }
    x = np.random.default_rng(0).normal(size=(2, 8)).astype("float32")
    inner_out = mixed.get_layer("inner")(x)
    assert keras.backend.standardize_dtype(inner_out.dtype) == low
    # Stock Keras, building the same model under the policy, reports the same.
    keras.config.set_dtype_policy(policy)
    inner = _encoder("inner")
    inputs = keras.Input((8,))
    stock = keras.Model(inputs, keras.layers.Dense(3, name="top")(inner(inputs)), name="outer")
    assert {k: v[0] for k, v in _reported(stock).items()} == {
        k: v[0] for k, v in _reported(mixed).items()}


def test_a_pinned_nested_model_reports_float32():
    inner = _encoder("inner")
    inputs = keras.Input((8,))
    outer = keras.Model(inputs, keras.layers.Dense(3, name="top")(inner(inputs)), name="outer")
    mixed = kmp.convert(outer, kmp.Policy("mixed_float16", keep_fp32=["inner"]))
    assert mixed.get_layer("inner").compute_dtype == "float32"
    assert mixed.get_layer("inner").get_layer("inner_hidden").compute_dtype == "float32"
    assert mixed.get_layer("top").compute_dtype == "float16"


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_convert_takes_a_container_of_built_models_never_called_itself(policy):
    low = policy.removeprefix("mixed_")
    model = Siamese(name="siamese")
    assert not model.built and all(x.built for x in model._flatten_layers(include_self=False))
    rng = np.random.default_rng(0)
    a, b = (rng.normal(size=(16, 8)).astype("float32") for _ in range(2))
    y = rng.normal(size=(16, 1)).astype("float32")
    mixed = kmp.convert(model, policy)
    assert not model.built  # the original is left as it was
    for name in ("left", "right"):
        for w_old, w_new in zip(getattr(model, name).weights, getattr(mixed, name).weights):
            assert w_new.dtype == "float32"
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(w_old),
                                          keras.ops.convert_to_numpy(w_new))
    assert mixed.left.get_layer("left_hidden").compute_dtype == low
    assert mixed.left.compute_dtype == low
    if keras.backend.backend() == "jax" and low == "float16":
        return  # JAX's CPU has no float16 dot
    out = mixed((a, b))
    # its callers get float32 (issue 33.6); the math inside stays low (above)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_allclose(keras.ops.convert_to_numpy(out).astype("float32"),
                               keras.ops.convert_to_numpy(model((a, b))), atol=0.05)
    mixed.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    losses = mixed.fit((a, b), y, batch_size=8, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_convert_names_the_unbuilt_layer():
    class Half(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.encoder = _encoder("enc")
            self.head = keras.layers.Dense(1, name="unbuilt_head")

        def call(self, x):
            return self.head(self.encoder(x))

    with pytest.raises(ValueError, match=r"Model 'half' is not built: .*'unbuilt_head'"):
        kmp.convert(Half(name="half"), "mixed_bfloat16")
    with pytest.raises(ValueError, match="it has no layers with weights"):
        kmp.convert(keras.Sequential(name="empty"), "mixed_bfloat16")
