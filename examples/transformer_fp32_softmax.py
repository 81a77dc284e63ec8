"""A small transformer classifier whose attention softmax runs in float32.

`kmp.layers.MultiHeadAttention` is `keras.layers.MultiHeadAttention` with the attention
softmax computed in float32 (under `mixed_float16` the stock layer exponentiates and sums
in float16). With dropout the explicit softmax path is taken; this script checks that the
layer's softmax is keras_mp's FP32 one, then trains on a generated task for attention (name the
one marked token among distractors).

    python examples/transformer_fp32_softmax.py
    KERAS_MP_EXAMPLE_FAST=1 python examples/transformer_fp32_softmax.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp import layers as kmp_layers  # noqa: E402
from keras_mp import losses  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
# JAX on CPU has no float16 matmul; mixed_bfloat16 runs everywhere.
POLICY = os.environ.get("KERAS_MP_EXAMPLE_POLICY", "mixed_bfloat16")
LENGTH, CLASSES, DIM = 16, 10, 32
VOCAB = 2 * CLASSES + 2
N = 800 if FAST else 2000
EPOCHS = 2 if FAST else 10

# Data: random plain tokens 2..CLASSES+1 and, at one random position, a marked token
# (CLASSES+2 .. 2*CLASSES+1); the label is the marked token's class.
rng = np.random.default_rng(0)
x = rng.integers(2, CLASSES + 2, size=(N, LENGTH)).astype("int32")
y = rng.integers(0, CLASSES, size=N).astype("int32")
x[np.arange(N), rng.integers(0, LENGTH, size=N)] = y + CLASSES + 2
split = int(0.8 * N)


class PositionEmbedding(keras.layers.Layer):
    def build(self, input_shape):
        self.table = self.add_weight(shape=tuple(input_shape[1:]), name="table")

    def call(self, inputs):
        return inputs + keras.ops.cast(self.table, inputs.dtype)


keras.utils.set_random_seed(0)
kmp.set_global_policy(POLICY)  # layers created from here on compute in the low dtype

inputs = keras.Input((LENGTH,), dtype="int32")
h = PositionEmbedding()(keras.layers.Embedding(VOCAB, DIM)(inputs))
attention = kmp_layers.MultiHeadAttention(num_heads=4, key_dim=DIM // 4, dropout=0.1)
# Keras' LayerNormalization takes its statistics in float32 itself: no dtype= needed.
h = keras.layers.LayerNormalization()(h + attention(h, h))
ffn = keras.layers.Dense(DIM)(keras.layers.Dense(4 * DIM, activation="relu")(h))
h = keras.layers.LayerNormalization()(h + ffn)
h = keras.layers.GlobalAveragePooling1D()(h)
# The logits projection stays in the compute dtype (tensor cores); the loss below takes
# the log-softmax in float32 (kmp.convert makes the same choice for a linear output layer).
logits = keras.layers.Dense(CLASSES, name="logits")(h)
model = keras.Model(inputs, logits)

softmax = attention._softmax
print(
    f"attention computes in {attention.compute_dtype}; its softmax is "
    f"{type(softmax).__module__}.{type(softmax).__name__}"
)
optimizer = keras.optimizers.AdamW(3e-3)
if POLICY == "mixed_float16":
    optimizer = kmp.LossScaleOptimizer(optimizer)
model.compile(
    optimizer=optimizer,
    loss=losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
    jit_compile=True if POLICY.endswith("_float16") else "auto",
)
model.fit(
    x[:split],
    y[:split],
    batch_size=64,
    epochs=EPOCHS,
    verbose=2,
    validation_data=(x[split:], y[split:]),
)
loss, acc = model.evaluate(x[split:], y[split:], verbose=0)
print(f"{POLICY}: validation accuracy {acc:.3f} (chance {1 / CLASSES:.2f}), loss {loss:.4f}")
kmp.set_global_policy("float32")
