"""LeanOptimizer under MirroredStrategy on 2 logical CPUs vs one device (same global
batches). Prints `MAXDIFF replicas max|w_mirrored - w_single| max|w_single - w0|`."""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_mp as kmp  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)
rng = np.random.default_rng(0)
x = rng.normal(size=(48, 16)).astype("float32")
y = (x[:, 0] > 0).astype("int32")


def model_(policy):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    return kmp.convert(keras.Model(inputs, keras.layers.Dense(2)(h)), policy)


def train(strategy, policy):
    with strategy.scope():
        model = model_(policy)
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-2),
            loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    w0 = [np.asarray(v.value, "float32") for v in model.trainable_variables]
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    if policy == "mixed_bfloat16":
        return [np.asarray(v.value, "float32") for v in model.trainable_variables], w0
    assert isinstance(model.optimizer, kmp.LeanOptimizer)
    return [np.asarray(w, "float32") for w in model.optimizer.weights_float32()], w0


mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
for policy in ("lean_bfloat16", "mixed_bfloat16"):
    wm, w0 = train(mirrored, policy)
    ws, _ = train(tf.distribute.get_strategy(), policy)
    diff = np.mean([np.abs(a - b).mean() for a, b in zip(wm, ws)])
    moved = np.mean([np.abs(a - b).mean() for a, b in zip(ws, w0)])
    print("MEANDIFF", policy, mirrored.num_replicas_in_sync, diff, moved)
