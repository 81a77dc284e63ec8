"""keras_mp.conversion.model_copy: copying models as objects, and weights carried by identity."""

import keras
import numpy as np
import pytest

from keras_mp.conversion import model_copy


def _np(v):
    return np.asarray(keras.ops.convert_to_numpy(v.value if hasattr(v, "value") else v))


@keras.saving.register_keras_serializable(package="kmp_tests")
class TwoScales(keras.layers.Layer):
    """Two same-shaped variables, created in an order its config does not record."""

    def __init__(self, order="ab", **kwargs):
        super().__init__(**kwargs)
        self.order = order

    def build(self, input_shape):
        for name in self.order:
            setattr(self, name, self.add_weight(shape=(input_shape[-1],), name=name,
                                                initializer="ones"))

    def call(self, x):
        return x * self.a + self.b

    def get_config(self):  # `order` deliberately left out: a rebuilt layer creates "ab"
        return super().get_config()


def _two_scales_model():
    inputs = keras.Input((3,))
    layer = TwoScales(order="ba", name="scales")
    model = keras.Model(inputs, layer(inputs))
    layer.a.assign([1.0, 2.0, 3.0])
    layer.b.assign([10.0, 20.0, 30.0])
    return model


def test_weights_are_carried_by_identity_not_position():
    model = _two_scales_model()
    clone = keras.models.clone_model(model)  # rebuilt from config: creates a, then b
    assert [v.name for v in model.weights] == ["b", "a"]
    assert [v.name for v in clone.weights] == ["a", "b"]
    pairs = model_copy.pair_variables(model, clone)
    assert [(a.name, b.name) for a, b in pairs] == [("b", "b"), ("a", "a")]
    for a, b in pairs:
        b.assign(a)
    np.testing.assert_array_equal(_np(clone.get_layer("scales").a), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(_np(clone.get_layer("scales").b), [10.0, 20.0, 30.0])
    x = np.full((2, 3), 2.0, "float32")
    np.testing.assert_array_equal(_np(clone(x)), _np(model(x)))
    # Pairing by position (what Keras' set_weights does) would have swapped them:
    positional = keras.models.clone_model(model)
    positional.set_weights(model.get_weights())
    assert not np.array_equal(_np(positional(x)), _np(model(x)))


def test_unmatched_or_reshaped_weights_fail_naming_them():
    model = _two_scales_model()
    inputs = keras.Input((3,))
    other = keras.Model(inputs, keras.layers.Dense(3, name="scales")(inputs))
    with pytest.raises(ValueError, match="do not line up; unmatched"):
        model_copy.pair_variables(model, other)
    inputs = keras.Input((4,))
    wider = keras.Model(inputs, TwoScales(name="scales")(inputs))
    with pytest.raises(ValueError, match=r"differ in shape: \[\('scales/[ab]', \(3,\), \(4,\)\)"):
        model_copy.pair_variables(model, wider)


class Opaque(keras.Model):
    """No usable get_config (a constructor argument that is a layer), a shared layer."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer
        self.head = keras.layers.Dense(2)

    def call(self, x):
        return self.head(self.layer(x) + self.layer(x * 0.5))


def test_copy_model_copies_objects_not_configs():
    model = Opaque(keras.layers.Dense(4, name="shared"))
    x = np.ones((2, 4), "float32")
    model(x)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, np.zeros((2, 2), "float32"), verbose=0)
    twin, copied = model_copy.copy_model(model)
    assert copied and type(twin) is Opaque
    assert not twin.compiled and twin.optimizer is None  # compile state left behind
    assert twin.layer is not model.layer and twin.layer.name == "shared"
    assert [v.path for v in twin.weights] == [v.path for v in model.weights]
    for a, b in zip(model.weights, twin.weights, strict=True):
        assert a is not b
        np.testing.assert_array_equal(_np(a), _np(b))
    np.testing.assert_array_equal(_np(twin(x)), _np(model(x)))
    twin.layer.kernel.assign(np.zeros((4, 4), "float32"))  # the original is not affected
    assert np.abs(_np(model.layer.kernel)).max() > 0
    # The copy's trackers know its own layers (the original's ids were rewritten).
    tracker = twin._tracker
    assert tracker.is_in_store("layers", twin.layer)
    assert not tracker.is_in_store("layers", model.layer)


def test_copy_of_a_functional_model_saves_and_nested_models_stay_nested(tmp_path):
    inner_in = keras.Input((3,))
    inner = keras.Model(inner_in, keras.layers.Dense(3, name="inner_dense")(inner_in),
                        name="inner")
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(inner(inputs)))
    twin, _ = model_copy.copy_model(model)
    assert isinstance(twin.get_layer("inner"), keras.Model)
    assert twin.get_layer("inner") is not inner
    path = str(tmp_path / "twin.keras")
    twin.save(path)  # node keys renewed: Functional.get_config finds every node
    loaded = keras.saving.load_model(path)
    x = np.ones((2, 3), "float32")
    np.testing.assert_array_equal(_np(loaded(x)), _np(model(x)))


class KeepsAModule(keras.layers.Layer):
    """Holds a module as an attribute, as keras_hub's SD3 does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.numpy_module = np

    def call(self, x):
        return x * 2.0


def test_models_with_preprocessing_layers_and_modules_are_copied_as_objects():
    # Rescaling keeps Keras' backend switch (a DynamicBackend), which plain deepcopy
    # cannot copy; a module attribute cannot be pickled. Both are copied, not rebuilt.
    inputs = keras.Input((4,))
    x = keras.layers.Rescaling(0.5, name="rescale")(inputs)
    x = KeepsAModule(name="keeps")(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    twin, copied = model_copy.copy_model(model)
    assert copied
    assert twin.get_layer("keeps").numpy_module is np
    rescale = twin.get_layer("rescale")
    assert rescale is not model.get_layer("rescale")
    assert rescale.backend._backend == model.get_layer("rescale").backend._backend
    x = np.ones((2, 4), "float32")
    np.testing.assert_array_equal(_np(twin(x)), _np(model(x)))


def test_deep_functional_models_are_copied_as_objects():
    # Python's copy recurses along the graph (~25 frames a layer): 400 layers are past
    # the default recursion limit of 1,000, which copy_model raises while it copies.
    x = inputs = keras.Input((2,))
    for _ in range(400):
        x = keras.layers.Dense(2)(x)
    model = keras.Model(inputs, x)
    twin, copied = model_copy.copy_model(model)
    assert copied
    assert [v.path for v in twin.weights] == [v.path for v in model.weights]
    x = np.ones((1, 2), "float32")
    np.testing.assert_array_equal(_np(twin(x)), _np(model(x)))


def test_recast_variables_changes_dtypes_in_place():
    model = _two_scales_model()
    layer = model.get_layer("scales")
    variable = layer.a
    layer._dtype_policy = keras.DTypePolicy("bfloat16")
    assert model_copy.recast_variables(model) == 2
    assert layer.a is variable and variable.dtype == "bfloat16"  # the same Variable object
    np.testing.assert_array_equal(_np(variable).astype("float32"), [1.0, 2.0, 3.0])
    x = np.ones((2, 3), "float32")
    assert keras.backend.standardize_dtype(model(x).dtype) == "bfloat16"
