"""Data and models for the `keras-mp` runners: bundled digits, a generated sequence task.

Everything here is small enough for a 2-core CPU and needs no download: the digits come
with scikit-learn (`sklearn.datasets.load_digits`, 1,797 8x8 grey images of handwritten
digits, a real data set) and the sequence task is generated from a seed.
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import numpy as np

from keras_mp.cli.settings import MODELS

__all__ = [
    "MODELS",
    "Dataset",
    "PositionEmbedding",
    "build_model",
    "load_dataset",
    "load_digits",
    "make_sequences",
]


class Dataset(NamedTuple):
    """A train/validation split of a classification task.

    Attributes:
        x_train, y_train, x_val, y_val: numpy arrays (labels int32).
        num_classes: number of classes.
        name: a short description for tables and `results.json`.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    num_classes: int
    name: str


def _split(x, y, n_val: int, seed: int, limit: int | None, num_classes: int, name: str):
    order = np.random.RandomState(seed).permutation(len(x))
    x, y = x[order], y[order]
    x_train, y_train, x_val, y_val = x[n_val:], y[n_val:], x[:n_val], y[:n_val]
    if limit is not None:
        x_train, y_train = x_train[:limit], y_train[:limit]
        x_val, y_val = x_val[: max(limit // 4, 32)], y_val[: max(limit // 4, 32)]
    return Dataset(x_train, y_train, x_val, y_val, num_classes, name)


def load_digits(seed: int = 0, limit: int | None = None, n_val: int = 397) -> Dataset:
    """scikit-learn's bundled digits as 8x8x1 float32 images in [0, 1].

    Args:
        seed: seed of the shuffle before the split.
        limit: keep only this many training samples (and a quarter as many validation
            samples, at least 32); `None` keeps all (1,400 train / 397 validation).
        n_val: validation samples before `limit` applies.

    Returns:
        A `Dataset` with 10 classes.
    """
    from sklearn.datasets import load_digits as _load

    bunch = _load()
    x = (bunch.images / 16.0).astype("float32")[..., None]
    y = bunch.target.astype("int32")
    return _split(x, y, n_val, seed, limit, 10, "digits (sklearn, 8x8)")


def make_sequences(
    n: int = 1800, length: int = 16, classes: int = 10, seed: int = 0, limit: int | None = None
) -> Dataset:
    """A generated task for attention: name the one marked token among distractors.

    Tokens `2 .. classes+1` are plain, `classes+2 .. 2*classes+1` their marked versions.
    Each sequence holds random plain tokens and, at a random position, one marked token;
    the label is its class (`token - classes - 2`). Attention has to find the marked
    position; the plain tokens carry no information about the label.

    Args:
        n: number of sequences (a fifth is held out for validation).
        length: sequence length.
        classes: number of classes (the vocabulary has `2 * classes + 2` tokens).
        seed: generator seed.
        limit: as in `load_digits`.

    Returns:
        A `Dataset` with int32 token inputs of shape `(length,)`.
    """
    rng = np.random.RandomState(seed)
    x = rng.randint(2, classes + 2, size=(n, length)).astype("int32")
    y = rng.randint(0, classes, size=n).astype("int32")
    x[np.arange(n), rng.randint(0, length, size=n)] = y + classes + 2
    return _split(x, y, n // 5, seed, limit, classes, f"marked-token sequences (len {length})")


def load_dataset(model: str, seed: int = 0, limit: int | None = None) -> Dataset:
    """The data set a model kind trains on: digits for `cnn`/`mlp`, sequences otherwise."""
    if model in ("transformer", "t5"):
        return make_sequences(seed=seed, limit=limit)
    return load_digits(seed=seed, limit=limit)


@keras.saving.register_keras_serializable(package="keras_mp")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `(batch, length, dim)` input.

    Args:
        length: the sequence length.
        **kwargs: base layer arguments (`name`, `dtype`).
    """

    def __init__(self, length: int, **kwargs):
        super().__init__(**kwargs)
        self.length = int(length)

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.length, input_shape[-1]), initializer="glorot_uniform", name="embeddings"
        )

    def call(self, inputs):
        return inputs + keras.ops.cast(self.embeddings, inputs.dtype)

    def get_config(self):
        return {**super().get_config(), "length": self.length}


def build_model(kind: str, data: Dataset, seed: int = 0) -> keras.Model:
    """A small float32 model of `kind` (`"cnn"`, `"transformer"` or `"mlp"`) for `data`.

    The model is built under float32 with a fixed seed; the runners convert it to each
    precision policy, so every mode starts from the same weights. It returns logits.

    Args:
        kind: one of `MODELS`.
        data: the `Dataset` (input shape and number of classes).
        seed: weight-initialisation seed.

    Returns:
        A built functional `keras.Model`.
    """
    from keras import layers

    if kind not in MODELS:
        raise ValueError(f"model: unknown kind {kind!r}; choose from {', '.join(MODELS)}.")
    if kind == "t5":
        from keras_mp.cli.overflow import t5_encoder

        x = np.concatenate([data.x_train, data.x_val])  # the vocabulary of both splits
        return t5_encoder(x, data.num_classes, seed=seed)
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(data.x_train.shape[1:], name="inputs")
    if kind == "cnn":
        h = inputs
        for i, filters in enumerate((16, 32)):
            h = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{i}")(h)
            h = layers.BatchNormalization(name=f"bn{i}")(h)
            h = layers.ReLU(name=f"relu{i}")(h)
        h = layers.MaxPooling2D(name="pool")(h)
        h = layers.Flatten(name="flatten")(h)
    elif kind == "mlp":
        h = layers.Flatten(name="flatten")(inputs)
        h = layers.Dense(128, activation="relu", name="dense0")(h)
        h = layers.Dense(64, activation="relu", name="dense1")(h)
    else:
        length, dim = data.x_train.shape[1], 32
        vocab = int(max(data.x_train.max(), data.x_val.max())) + 1
        h = layers.Embedding(vocab, dim, name="tokens")(inputs)
        h = PositionEmbedding(length, name="positions")(h)
        att = layers.MultiHeadAttention(4, dim // 4, name="attention")(h, h)
        h = layers.LayerNormalization(name="ln0")(layers.Add(name="res0")([h, att]))
        ffn = layers.Dense(64, activation="relu", name="ffn0")(h)
        ffn = layers.Dense(dim, name="ffn1")(ffn)
        h = layers.LayerNormalization(name="ln1")(layers.Add(name="res1")([h, ffn]))
        h = layers.GlobalAveragePooling1D(name="pool")(h)
    outputs = layers.Dense(data.num_classes, name="logits")(h)
    return keras.Model(inputs, outputs, name=f"{kind}_{data.num_classes}way")
