"""Training runs for tests/test_fingerprint.py, importable and runnable in a subprocess.

    python tests/_fingerprint_worker.py onednn OUT.json   # TF_ENABLE_ONEDNN_OPTS from the env
    python tests/_fingerprint_worker.py onednn+mirrored OUTDIR   # onednn1.json, then a/b/c.json
                                                          # under MirroredStrategy, 2 logical CPUs

oneDNN is switched on or off when TensorFlow is imported, and logical devices must be set
before TensorFlow starts, so those runs need their own process. Every run trains the same
small MLP on the same generated batches (batch `BATCH`, one epoch, no shuffling) with
`kmp.LossScaleOptimizer(Adam)` and a `kmp.fingerprint.Fingerprint` recording every step.
"""

import os
import sys

import numpy as np

BATCH = 32


def data(steps: int, *, swap: int = 0, nan: int = 0, shard: int = 0, batch: int = BATCH):
    """`steps` batches of 64 features, 10 classes. `swap=k`: the batches of steps k and
    k+1 trade places; `nan=k`: a NaN in the batch of step k; `shard=k`: the second half of
    the batch of step k (the second replica's shard) is different data."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 64)).astype("float32")
    w = rng.normal(size=(64, 10))
    y = (x @ w + rng.normal(size=(batch * steps, 10))).argmax(-1).astype("int32")
    if swap:
        a, b = slice((swap - 1) * batch, swap * batch), slice(swap * batch, (swap + 1) * batch)
        x[a], x[b] = x[b].copy(), x[a].copy()
        y[a], y[b] = y[b].copy(), y[a].copy()
    if nan:
        x[(nan - 1) * batch + 3, 5] = np.nan
    if shard:
        rows = slice((shard - 1) * batch + batch // 2, shard * batch)
        x[rows] = np.random.default_rng(1).normal(size=x[rows].shape)
    return x, y


def build(keras, kmp, lr: float = 1e-3, width: int = 128):
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(width, activation="relu", name="hidden1"),
        keras.layers.Dense(width, activation="relu", name="hidden2"),
        keras.layers.Dense(10, dtype="float32", name="logits"),
    ])
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(lr))
    return model, opt


def train(path, *, policy="mixed_float16", steps=12, jit_compile=True, lr=1e-3, swap=0,
          nan=0, shard=0, batch=BATCH, every=1, seed=0):
    """Trains one run and writes its fingerprint to `path`; returns the callback."""
    import keras

    import keras_mp as kmp

    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(seed)
    x, y = data(steps, swap=swap, nan=nan, shard=shard, batch=batch)
    model, opt = build(keras, kmp, lr)
    model.compile(
        optimizer=opt,
        loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    fp = kmp.fingerprint.Fingerprint(path, every_n_steps=every)
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[fp])
    return fp


def mirrored_setup():
    """Two logical CPUs (before TensorFlow starts)."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def run_mirrored(out_dir):
    """Runs a, b, c under MirroredStrategy: b's second replica gets other data at step 5."""
    import keras
    import tensorflow as tf

    import keras_mp as kmp

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for name, shard in (("a", 0), ("b", 5), ("c", 0)):
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        x, y = data(8, shard=shard, batch=16)
        with strategy.scope():
            model, opt = build(keras, kmp, width=32)
            model.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(
                from_logits=True), jit_compile=False)
        fp = kmp.fingerprint.Fingerprint(os.path.join(out_dir, f"{name}.json"), every_n_steps=1)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[fp])


if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "onednn":
        # oneDNN runs bfloat16 matmuls on AVX512-BF16 CPUs; float16 and float32 matmuls of
        # this MLP came out bit-identical with it on and off (measured 2026-12-01).
        train(out, policy="mixed_bfloat16", steps=12, jit_compile=False)
    elif mode == "onednn+mirrored":  # one process less for the test: same run, then Mirrored
        mirrored_setup()
        train(os.path.join(out, "onednn1.json"), policy="mixed_bfloat16", steps=12,
              jit_compile=False)
        run_mirrored(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("done", flush=True)
