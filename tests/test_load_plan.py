"""What `kmp.convert` decided comes back when the model is loaded (issue 52).

* Token ids through a float `Input` under `lean_bfloat16`: `convert` stops the input cast
  of the layer that holds the `Embedding`; a Functional model's config saved no trace of
  the conversion, so after loading the ids were rounded to bfloat16 again (1999 became
  2000, past the 2000-row table).
"""

import keras
import numpy as np
import pytest

import keras_mp as kmp
import keras_mp.load_plan as load_plan

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
