"""Multi-worker mixed-precision training, started on one machine.

Run without arguments, this script starts two copies of itself as the workers of one
`tf.distribute.MultiWorkerMirroredStrategy` cluster on 127.0.0.1 (each with its own
`TF_CONFIG`), waits for both, and checks that they finished in the same state. Each
worker trains a small float16 MLP on its half of every global batch with
`kmp.LossScaleOptimizer`. The scale starts deliberately high (2**24), so the first steps
overflow in float16: `LossScaleOptimizer` all-reduces the finiteness of the gradients
before deciding, so both workers skip exactly the same steps and end with the same loss
scale, counters and weights.

    python examples/multi_device.py
    KERAS_MP_EXAMPLE_FAST=1 python examples/multi_device.py

On several machines, start the worker part on each host with `TF_CONFIG` listing every
host (`keras_mp.tf.distribute.local_tf_configs` builds it for one machine). Notes:
Keras 3.15's `model.fit` fails under MultiWorkerMirroredStrategy before its first step
(keras-team/keras#20585), hence the custom loop; and XLA (`jit_compile=True`) cannot
compile cross-worker collectives on CPUs, so the step is a plain `tf.function` here
(`kmp.LossScaleOptimizer` raises `UnsupportedJitCompileError` if you try). TensorFlow
backend only.
"""

import hashlib
import json
import os
import sys

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
STEPS = 40 if FAST else 300
GLOBAL_BATCH = 64


def worker():
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG; create it first
    import keras
    from sklearn.datasets import load_digits

    import keras_mp as kmp
    from keras_mp import losses

    digits = load_digits()
    x = (digits.images.reshape(-1, 64) / 16.0).astype("float32")
    y = digits.target.astype("int32")
    train = tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500]))
    train = train.shuffle(1500, seed=0).repeat().batch(GLOBAL_BATCH)  # global batches
    options = tf.data.Options()  # each worker takes its own half of every global batch
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = strategy.experimental_distribute_dataset(train.with_options(options))

    with strategy.scope():
        keras.utils.set_random_seed(0)  # same initial weights on every worker
        keras.config.set_dtype_policy("mixed_float16")
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10, dtype="float32"),  # float32 logits
        ])
        keras.config.set_dtype_policy("float32")
        optimizer = kmp.LossScaleOptimizer(
            keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0**24, growth_interval=100
        )
        optimizer.build(model.trainable_variables)
    loss_fn = losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    def replica_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True)) / GLOBAL_BATCH
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)  # skips on every worker or none

    @tf.function
    def train_step(images, labels):
        strategy.run(replica_step, args=(images, labels))

    for _, (images, labels) in zip(range(STEPS), train):
        train_step(images, labels)

    logits = model(x[1500:], training=False)
    accuracy = float(np.mean(np.argmax(np.asarray(logits), -1) == y[1500:]))
    weights = np.concatenate([np.ravel(w) for w in model.get_weights()])
    print(json.dumps({
        "worker": strategy.cluster_resolver.task_id,
        "applied": int(optimizer.iterations.numpy()),
        "skipped": int(optimizer.skipped_steps.numpy()),
        "scale": float(optimizer.loss_scale.numpy()),
        "accuracy": accuracy,
        "weights_sum": float(np.sum(weights, dtype="float64")),
        "weights_hash": hashlib.sha256(weights.tobytes()).hexdigest(),
    }), flush=True)


def main():
    from keras_mp.tf.distribute import launch_local_workers

    results = launch_local_workers([sys.executable, os.path.abspath(__file__)], num_workers=2)
    reports = [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]
    for r in reports:
        print(f"worker {r['worker']}: {r['applied']} steps applied, {r['skipped']} skipped, "
              f"loss scale {r['scale']:g}, validation accuracy {r['accuracy']:.3f}, "
              f"sum of weights {r['weights_sum']:.6f}")
    keys = ("applied", "skipped", "scale", "weights_hash")
    if any(r[k] != reports[0][k] for r in reports for k in keys):
        sys.exit("workers disagree")
    print("workers agree bit for bit: same skipped steps, loss scale and weights")


if __name__ == "__main__":
    worker() if "TF_CONFIG" in os.environ else main()
