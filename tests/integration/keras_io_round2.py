"""keras.io examples of issue 47's second round, at tiny sizes, on stand-in data.

* `TokenAndPositionEmbedding` and `TransformerBlock`: the "Text classification with
  Transformer" example's layers as written there (the block makes its sublayers in
  `__init__` and passes no `dtype` to them; both registered so that `.keras` files load),
  and `text_classifier`, its model: `Input(shape=(maxlen,))`, float32, holding token ids.
* `steep_model` / `steep_loss`: a loss whose gradients need a small loss scale, as
  SimCLR's contrastive loss does (its gradients overflow float16 above a scale of 64).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

__all__ = [
    "TokenAndPositionEmbedding",
    "TransformerBlock",
    "steep_data",
    "steep_loss",
    "steep_model",
    "text_classifier",
]


@keras.saving.register_keras_serializable(package="keras_io_round2")
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.embed_dim, self.num_heads, self.ff_dim, self.rate = embed_dim, num_heads, ff_dim, rate
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)

    def get_config(self):
        return {
            **super().get_config(),
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "ff_dim": self.ff_dim,
            "rate": self.rate,
        }


@keras.saving.register_keras_serializable(package="keras_io_round2")
class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.maxlen, self.vocab_size, self.embed_dim = maxlen, vocab_size, embed_dim
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions

    def get_config(self):
        return {
            **super().get_config(),
            "maxlen": self.maxlen,
            "vocab_size": self.vocab_size,
            "embed_dim": self.embed_dim,
        }


def text_classifier(maxlen=4, vocab_size=2000, embed_dim=16, num_heads=2, ff_dim=16):
    """The example's model (float32 `Input` of token ids), at a tiny size."""
    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(8, activation="relu")(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


def steep_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16,))
    h = layers.Dense(16, activation="tanh")(inputs)
    return keras.Model(inputs, layers.Dense(16)(h))


def steep_loss(y_true, y_pred):
    """Squared error times 4000: its scaled gradients overflow float16's 65504 at a
    loss scale of 128 (measured: a static 64 skips no step of the first batch)."""
    return 4000.0 * ops.mean(ops.square(y_pred - y_true), axis=-1)


def steep_data(n=480, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, (np.tanh(x) * 4.0).astype("float32")
