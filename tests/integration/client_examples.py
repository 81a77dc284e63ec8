"""Client code of four kinds keras.io trains in mixed precision, at tiny sizes, offline.

Adapted from the keras.io examples only so far as to run without downloads (keras_hub
models built from small explicit kwargs, synthetic data):

* `siamese`: sentence embeddings with a siamese RoBERTa ("Sentence embeddings using
  Siamese RoBERTa-networks"): a subclassed regression model holding a RoBERTa encoder
  (backbone, mean pooling, L2 normalisation) that embeds both sentences; the loss is the
  MSE between the cosine similarity and the label. The container is never called before
  conversion, as in the example.
* `lora`: GPT-2 fine-tuned with LoRA ("Efficiently fine-tune GPT-2 with LoRA"):
  `backbone.enable_lora(rank)`, AdamW, sparse cross-entropy from logits with weighted
  accuracy on next-token prediction.
* `float8`: the float8 transformer recipe ("Float8 training and inference with a simple
  Transformer model"): token and position embedding, a Transformer encoder block, pooling
  and a softmax head, `model.quantize("float8")`, then training.
* `custom_loss`: a DreamBooth-style trainer: a subclassed model around a denoiser and a
  frozen text encoder, whose `compute_loss` is the MSE between the predicted and the
  added noise.

Each `build_*` returns `(model, data)` with the float32 model; `train(kind, policy)`
converts it with `kmp.convert`, compiles as the example does and fits.
"""

from __future__ import annotations

import keras
import numpy as np

import keras_mp as kmp

__all__ = ["KINDS", "build", "train"]

KINDS = ("siamese", "lora", "float8", "custom_loss")
_VOCAB, _SEQ, _N = 64, 8, 16


def _tokens(rng, n=_N, seq=_SEQ):
    return rng.integers(1, _VOCAB, size=(n, seq)).astype("int32")


# -- siamese RoBERTa ------------------------------------------------------------------------


def _roberta_encoder() -> keras.Model:
    import keras_hub

    backbone = keras_hub.models.RobertaBackbone(
        vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=_SEQ)
    inputs = {
        "token_ids": keras.Input((_SEQ,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((_SEQ,), dtype="int32", name="padding_mask"),
    }
    hidden = backbone(inputs)
    pooled = keras.layers.GlobalAveragePooling1D(name="mean_pool")(
        hidden, inputs["padding_mask"])
    normed = keras.layers.UnitNormalization(axis=1, name="l2_norm")(pooled)
    return keras.Model(inputs, normed, name="sentence_encoder")


class RegressionSiamese(keras.Model):
    """Cosine similarity of two sentence embeddings (the keras.io example's model)."""

    def __init__(self, encoder: keras.Model, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder

    def call(self, inputs):
        first = self.encoder({"token_ids": inputs["first"], "padding_mask": inputs["first_mask"]})
        second = self.encoder(
            {"token_ids": inputs["second"], "padding_mask": inputs["second_mask"]})
        cosine = keras.ops.sum(keras.ops.cast(first, "float32")
                               * keras.ops.cast(second, "float32"), axis=1)
        return keras.ops.expand_dims(cosine, -1)


def build_siamese(rng):
    model = RegressionSiamese(_roberta_encoder(), name="siamese")
    mask = np.ones((_N, _SEQ), "int32")
    x = {"first": _tokens(rng), "first_mask": mask, "second": _tokens(rng), "second_mask": mask}
    y = rng.uniform(-1, 1, size=(_N, 1)).astype("float32")
    return model, (x, y)


# -- GPT-2 LoRA -----------------------------------------------------------------------------


def build_lora(rng):
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=_SEQ + 1)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    lm.backbone.enable_lora(rank=4)
    tokens = _tokens(rng, seq=_SEQ + 1)
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((_N, _SEQ), "int32")}
    return lm, (x, tokens[:, 1:], np.ones((_N, _SEQ), "float32"))


# -- float8 transformer ---------------------------------------------------------------------


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1])
        return self.token_emb(x) + self.pos_emb(positions)


def build_float8(rng):
    inputs = keras.Input((_SEQ,), dtype="int32")
    x = TokenAndPositionEmbedding(_SEQ, _VOCAB, 16, name="embedding")(inputs)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="attention")(x, x)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="ln_1")(x + attention)
    ffn = keras.layers.Dense(32, activation="relu", name="ffn_1")(x)
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="ln_2")(
        x + keras.layers.Dense(16, name="ffn_2")(ffn))
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(16, activation="relu", name="dense")(x)
    outputs = keras.layers.Dense(2, activation="softmax", name="head")(x)
    model = keras.Model(inputs, outputs, name="float8_transformer")
    return model, (_tokens(rng), rng.integers(0, 2, size=(_N,)).astype("int32"))


# -- DreamBooth-style trainer with its own compute_loss -------------------------------------


class NoisePredictionTrainer(keras.Model):
    """Predicts the noise added to the images from the noised images and a frozen text
    encoder's embedding; the loss is computed by `compute_loss`, in float32."""

    def __init__(self, denoiser: keras.Model, text_encoder: keras.Model, **kwargs):
        super().__init__(**kwargs)
        self.denoiser = denoiser
        self.text_encoder = text_encoder
        self.text_encoder.trainable = False

    def call(self, inputs):
        noisy = inputs["images"] + inputs["noise"]
        return self.denoiser([noisy, self.text_encoder(inputs["prompt"])])

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        error = keras.ops.cast(y_pred, "float32") - keras.ops.cast(x["noise"], "float32")
        return keras.ops.mean(keras.ops.square(error))


def build_custom_loss(rng):
    prompt = keras.Input((_SEQ,), dtype="int32")
    text = keras.layers.Embedding(_VOCAB, 8)(prompt)
    text_encoder = keras.Model(prompt, keras.layers.GlobalAveragePooling1D()(text),
                               name="text_encoder")
    images = keras.Input((8, 8, 3))
    context = keras.Input((8,))
    h = keras.layers.Conv2D(8, 3, padding="same", activation="silu")(images)
    h = h + keras.layers.Reshape((1, 1, 8))(keras.layers.Dense(8)(context))
    h = keras.layers.GroupNormalization(groups=2)(h)
    out = keras.layers.Conv2D(3, 3, padding="same")(h)
    denoiser = keras.Model([images, context], out, name="denoiser")
    trainer = NoisePredictionTrainer(denoiser, text_encoder, name="dreambooth")
    x = {
        "images": rng.uniform(-1, 1, size=(_N, 8, 8, 3)).astype("float32"),
        "noise": rng.normal(size=(_N, 8, 8, 3)).astype("float32"),
        "prompt": _tokens(rng),
    }
    return trainer, (x,)


# -- running them ---------------------------------------------------------------------------

_BUILDERS = {"siamese": build_siamese, "lora": build_lora, "float8": build_float8,
             "custom_loss": build_custom_loss}


def build(kind: str, seed: int = 0):
    """The float32 model of `kind` and its data (a tuple: `(x,)`, `(x, y)` or `(x, y, w)`)."""
    keras.utils.set_random_seed(seed)
    return _BUILDERS[kind](np.random.default_rng(seed))


def _compile(kind: str, model: keras.Model) -> None:
    if kind == "siamese":
        model.compile(optimizer=keras.optimizers.Adam(2e-3), loss="mse")
    elif kind == "lora":
        model.compile(
            optimizer=keras.optimizers.AdamW(5e-3, weight_decay=0.01, epsilon=1e-6),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"])
    elif kind == "float8":
        model.compile(optimizer=keras.optimizers.Adam(2e-3),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    else:
        model.compile(optimizer=keras.optimizers.AdamW(2e-3, weight_decay=0.01))


def train(kind: str, policy: str, epochs: int = 3, callbacks=None, seed: int = 0):
    """Builds `kind` in float32, converts it to `policy`, compiles and fits it.

    Returns:
        `(float32_model, converted_model, history)`.
    """
    model, data = build(kind, seed)
    mixed = kmp.convert(model, policy)
    if kind == "float8":
        mixed.quantize("float8")
    _compile(kind, mixed)
    history = mixed.fit(**dict(zip(("x", "y", "sample_weight"), data)), batch_size=8,
                        epochs=epochs, verbose=0, callbacks=callbacks or [])
    return model, mixed, history
