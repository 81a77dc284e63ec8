"""Convert an existing float32 model to mixed precision and keep training it.

`kmp.convert(model, policy)` returns a copy of the model under the policy: every layer
computes in the low dtype except the keep-list (normalization, softmax, attention, the
logits layer), and the weights are carried over bit for bit (the FP32 master weights).

    python examples/convert_fp32_model.py
    KERAS_MP_EXAMPLE_FAST=1 python examples/convert_fp32_model.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp import losses  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
# mixed_bfloat16 is fast on CPUs and has no overflow; use mixed_float16 on NVIDIA GPUs.
POLICY = os.environ.get("KERAS_MP_EXAMPLE_POLICY", "mixed_bfloat16")
EPOCHS = 1 if FAST else 5

digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., None]
y = digits.target
x_train, y_train, x_val, y_val = x[:1400], y[:1400], x[1400:], y[1400:]

# 1. An ordinary float32 model, trained a little.
keras.utils.set_random_seed(0)
inputs = keras.Input((8, 8, 1))
h = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inputs)
h = keras.layers.BatchNormalization()(h)
h = keras.layers.ReLU()(h)
h = keras.layers.Flatten()(h)
h = keras.layers.Dense(64, activation="relu")(h)
outputs = keras.layers.Dense(10, activation="softmax", name="probs")(h)
fp32 = keras.Model(inputs, outputs)
fp32.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
fp32.fit(x_train, y_train, epochs=EPOCHS, batch_size=32, verbose=0)
print(f"float32 model: validation accuracy {fp32.evaluate(x_val, y_val, verbose=0)[1]:.3f}")

# 2. Convert: same weights, low-precision compute, the keep-list in float32.
mixed = kmp.convert(fp32, POLICY)
print(f"{'layer':<22} {'policy':<16} variables")
for layer in mixed.layers[1:]:
    dtypes = {v.dtype for v in layer.weights} or {"-"}
    print(f"{layer.name:<22} {layer.dtype_policy.name:<16} {', '.join(sorted(dtypes))}")
same = all(
    np.array_equal(a, b) for a, b in zip(fp32.get_weights(), mixed.get_weights(), strict=True)
)
print(f"weights carried over exactly: {same}")
gap = np.max(np.abs(fp32.predict(x_val, verbose=0) - mixed.predict(x_val, verbose=0)))
print(f"max |p_fp32 - p_{POLICY}| before fine-tuning: {gap:.2e}")

# 3. Keep training the converted model (compile it again: kmp optimizer and loss).
optimizer = keras.optimizers.Adam(1e-3)
if POLICY == "mixed_float16":
    optimizer = kmp.LossScaleOptimizer(optimizer)
mixed.compile(
    optimizer=optimizer,
    loss=losses.SparseCategoricalCrossentropy(),  # the model outputs probabilities
    metrics=["accuracy"],
    jit_compile=True if POLICY.endswith("_float16") else "auto",
)
mixed.fit(x_train, y_train, epochs=EPOCHS, batch_size=32, verbose=0)
print(
    f"{POLICY} model after {EPOCHS} more epoch(s): validation accuracy "
    f"{mixed.evaluate(x_val, y_val, verbose=0)[1]:.3f}"
)
