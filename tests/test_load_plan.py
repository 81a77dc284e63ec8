"""What `kmp.convert` decided comes back when the model is loaded (issue 52).

* Token ids through a float `Input` under `lean_bfloat16`: `convert` stops the input cast
  of the layer that holds the `Embedding`; a Functional model's config saved no trace of
  the conversion, so after loading the ids were rounded to bfloat16 again (1999 became
  2000, past the 2000-row table).
* A custom layer whose `get_config` omits its dtype (keras.io's subclassing guide's first
  version) and the sublayers it makes in `__init__` loaded in float32 beside bfloat16
  layers: under `lean_bfloat16` the saved optimizer state no longer matched (an error
  about `pack_small`), and where the counts happened to match it loaded in another layout.
* A lean model compiled but never trained could not be loaded (2 saved optimizer
  variables, 9 built: the same `pack_small` error).
"""

import keras
import numpy as np
import pytest

import keras_mp as kmp
import keras_mp.saving.plan as load_plan

VOCAB, WIDTH = 2000, 16
IDS = np.array([[1999, 1998, 257, 3], [1001, 0, 1999, 256]], "float32")


@keras.saving.register_keras_serializable(package="test_load_plan")
class TokenEmbedding(keras.layers.Layer):
    """keras.io's text classifier's shape: an `Embedding` inside a layer of one's own."""

    def __init__(self, vocab, width, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.width = vocab, width
        self.token_emb = keras.layers.Embedding(vocab, width)

    def call(self, x):
        return self.token_emb(x)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "width": self.width}


def _bits_table():
    """Row i holds i's binary digits (0/1: exact in bfloat16), so a wrong row shows."""
    ids = np.arange(VOCAB)[:, None]
    return ((ids >> np.arange(WIDTH)) & 1).astype("float32")


def _text_model():
    inputs = keras.Input(shape=(4,))  # float32, as keras.io declares it
    embedding = TokenEmbedding(VOCAB, WIDTH)
    model = keras.Model(inputs, embedding(inputs))
    embedding.token_emb.embeddings.assign(_bits_table())
    return model


def _predict(model):
    return keras.ops.convert_to_numpy(keras.ops.cast(model.predict_on_batch(IDS), "float32"))


@pytest.mark.parametrize("loader", ["kmp", "keras"])
def test_token_ids_keep_their_rows_after_loading(loader, tmp_path):
    converted = kmp.convert(_text_model(), "lean_bfloat16")
    want = _bits_table()[IDS.astype(int)]
    before = _predict(converted)
    np.testing.assert_array_equal(before, want)
    path = str(tmp_path / "text.keras")
    if loader == "kmp":
        kmp.saving.save_model(converted, path)
        loaded = kmp.saving.load_model(path)
    else:
        converted.save(path)
        loaded = keras.saving.load_model(path)
    # 1999 was rounded to 2000 (past the table: an error) and 257 to 256 (a wrong row).
    np.testing.assert_array_equal(_predict(loaded), before)
    assert keras.backend.standardize_dtype(loaded.predict_on_batch(IDS).dtype) == "float32"
    assert loaded.get_layer("token_embedding").token_emb.compute_dtype == "bfloat16"
    assert load_plan.saved_plan(loaded.get_config()) is not None


def test_a_plain_functional_config_is_unchanged():
    model = _text_model()
    assert "dtype" not in model.get_config()


@keras.saving.register_keras_serializable(package="test_load_plan")
class GuideBlock(keras.layers.Layer):
    """The subclassing guide's first version: no **kwargs, a get_config without dtype."""

    def __init__(self, units=32):
        super().__init__()
        self.units = units
        self.dense_1 = keras.layers.Dense(units)
        self.dense_2 = keras.layers.Dense(units)

    def call(self, x):
        return self.dense_2(keras.ops.relu(self.dense_1(x)))

    def get_config(self):
        return {"units": self.units}


def _guide_model(sequential=False):
    layers = [GuideBlock(128), keras.layers.Dense(4)]
    if sequential:
        return keras.Sequential([keras.Input((64,)), *layers])
    inputs = keras.Input((64,))
    return keras.Model(inputs, layers[1](layers[0](inputs)))


def _numpy(values):
    return [
        np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(getattr(v, "value", v), "float32")))
        for v in values
    ]


@pytest.mark.parametrize("sequential, loader", [(False, "kmp"), (True, "keras")])
def test_layer_saved_without_its_dtype_loads_in_the_saved_one(sequential, loader, tmp_path):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 64)).astype("float32"), rng.normal(size=(4, 4)).astype("float32")
    model = kmp.convert(_guide_model(sequential), "lean_bfloat16", check=None)
    model.compile(optimizer="adamw", loss="mse")
    if sequential:  # the state's layout, without a (slow to compile) lean step
        model.optimizer.build(model.trainable_variables)
    else:
        model.train_on_batch(x, y)
    path = str(tmp_path / "guide.keras")
    kmp.saving.save_model(model, path)
    loaded = (kmp.saving.load_model if loader == "kmp" else keras.saving.load_model)(path)
    # float32 before: the block's sublayers were made with the global policy
    assert [v.dtype for v in loaded.weights] == [v.dtype for v in model.weights]
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
    for want, got in zip(_numpy(model.optimizer.variables), _numpy(loaded.optimizer.variables)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        _numpy([loaded.predict_on_batch(x)]), _numpy([model.predict_on_batch(x)])
    )
    assert int(loaded.optimizer.iterations) == (0 if sequential else 1)


def test_file_without_the_plan_names_the_layer_and_the_fix(tmp_path):
    model = kmp.convert(_guide_model(), "lean_bfloat16", check=None)
    model.compile(optimizer="adamw", loss="mse")
    model.optimizer.build(model.trainable_variables)
    path = str(tmp_path / "old.keras")
    with load_plan.scope():
        load_plan.uninstall()  # as a keras_mp before the plan was saved wrote it
        try:
            model.save(path)
        finally:
            load_plan.install()
    with pytest.raises(ValueError) as e:
        kmp.saving.load_model(path)
    assert "['guide_block']" in str(e.value) and "super().get_config()" in str(e.value)


def test_lean_model_saved_before_its_first_step_loads(tmp_path):
    model = kmp.convert(_guide_model(), "lean_bfloat16", check=None)
    model.compile(optimizer="adamw", loss="mse")
    path = str(tmp_path / "fresh.keras")
    kmp.saving.save_model(model, path)
    loaded = kmp.saving.load_model(path)  # 2 saved optimizer variables, 9 built: an error
    assert loaded.optimizer.built and int(loaded.optimizer.iterations) == 0
    assert len(loaded.optimizer.variables) == 9
