"""Export a mixed-precision model as a SavedModel with a float32 serving signature.

A model trained under `mixed_float16` computes in float16; `model.export()` would serve
float16 tensors. `kmp.export_saved_model` writes an endpoint `serve` that takes and returns
float32: `compute="mixed"` serves the model as trained (float16 matmuls, for GPUs),
`compute="float32"` an FP32 clone with the same weights (for CPUs). The artifact loads
with TensorFlow alone. TensorFlow backend only.

    python examples/export_saved_model.py
    KERAS_MP_EXAMPLE_FAST=1 python examples/export_saved_model.py
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tempfile  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp import losses  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
OUT = os.environ.get("KERAS_MP_EXAMPLE_OUT") or tempfile.mkdtemp(prefix="keras_mp_export_")
os.makedirs(OUT, exist_ok=True)

digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., None]
y = digits.target

# Train a small mixed_float16 model.
keras.utils.set_random_seed(0)
inputs = keras.Input((8, 8, 1), name="image")
h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
h = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(h))
model = kmp.convert(keras.Model(inputs, keras.layers.Dense(10, name="logits")(h)), "mixed_float16")
model.compile(
    optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
    loss=losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
    jit_compile=True,
)
model.fit(
    x[: 320 if FAST else 1400],
    y[: 320 if FAST else 1400],
    epochs=1 if FAST else 5,
    batch_size=32,
    verbose=0,
)

# Export twice: as trained (float16 compute inside), and as an FP32 clone for CPU serving.
for compute in ("mixed", "float32"):
    path = os.path.join(OUT, f"digits_{compute}")
    kmp.export_saved_model(model, path, serving_dtype="float32", compute=compute)

    # Serving side: TensorFlow only, no Keras or keras_mp objects needed.
    served = tf.saved_model.load(path)
    batch = tf.constant(x[1400:1432])
    out = served.serve(batch)
    reference = model.predict(x[1400:1432], verbose=0).astype("float32")
    gap = float(np.max(np.abs(out.numpy() - reference)))
    signature = served.signatures["serving_default"]
    (spec,) = signature.structured_input_signature[1].values()
    print(
        f"{compute:>7}: {path}\n         signature input {spec.dtype.name}{spec.shape}, "
        f"output {out.dtype.name}{tuple(out.shape)}, max |served - keras| = {gap:.2e}"
    )
print(
    f"served accuracy on 32 held-out digits: "
    f"{float(np.mean(np.argmax(out.numpy(), -1) == y[1400:1432])):.3f}"
)
