"""Subprocess side of tests/test_lean_distribute.py: the lean state on several devices.

    python tests/_lean_distribute_worker.py mirrored      # 2 logical CPUs, MirroredStrategy
    python tests/_lean_distribute_worker.py multiworker   # a MultiWorkerMirroredStrategy worker
    python tests/_lean_distribute_worker.py jax           # 4 host devices, keras.distribution
    python tests/_lean_distribute_worker.py jax_process PROCESS_ID PORT   # 2 processes x 2

Device counts are fixed when TensorFlow / JAX start, hence a process per scenario. Each
trains the same small model (two Dense layers around LayerNormalizations: several
variables of one shape) on the same global batches, and prints one JSON line last:
final float32 weights, per-device bytes of state per parameter, and the one-device run
to compare with.
"""

import json
import os
import sys

MODE = sys.argv[1]
os.environ["KERAS_BACKEND"] = "jax" if MODE.startswith("jax") else "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if MODE.startswith("jax"):
    count = 2 if MODE == "jax_process" else 4
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"

import numpy as np  # noqa: E402

BATCH, STEPS, WIDTH = 16, 4, 64
_rng = np.random.default_rng(0)
X = _rng.normal(size=(BATCH * STEPS, WIDTH)).astype("float32")
Y = _rng.normal(size=(BATCH * STEPS, WIDTH)).astype("float32")


# The lean state these scenarios (and docs/distributed.md's table) measure: kahan + int8,
# the default before 2026-12-03 (5 bytes a parameter: its compensation buffer is int8, what
# TensorFlow's collective broadcast refused). The default stochastic + int4 state's blocks
# per shard: tests/test_lean_int4.py::test_int4_blocks_follow_the_shards.
KAHAN_INT8 = {"rounding": "kahan", "moments": "int8"}


def make_model(keras, kmp, policy="lean_bfloat16", weights=None, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((WIDTH,))
    h = keras.layers.LayerNormalization(name="ln_in")(inputs)
    h = keras.layers.Dense(4 * WIDTH, activation="relu", name="up")(h)
    h = keras.layers.Dense(WIDTH, name="down")(h)
    h = keras.layers.LayerNormalization(name="ln_out")(h)
    outputs = keras.layers.Dense(WIDTH, name="head")(h)
    model = kmp.convert(keras.Model(inputs, outputs), policy)
    if weights is not None:
        model.set_weights(weights)
    return model


def float32_weights(model, opt):
    import keras

    import keras_mp as kmp

    if isinstance(opt, kmp.LeanOptimizer):
        values = opt.weights_float32()
    else:
        values = [v.value for v in model.trainable_variables]
    return [np.asarray(keras.ops.convert_to_numpy(w), "float32") for w in values]


def emit(result):
    print(json.dumps(result), flush=True)


def listed(arrays):
    return [a.tolist() for a in arrays]


# -- TensorFlow ---------------------------------------------------------------------------


def tf_train(tf, keras, kmp, strategy, policy, weights=None, seed=0, global_batch=BATCH):
    """A custom loop under `strategy` (model.fit fails under MultiWorkerMirroredStrategy
    in Keras 3.15, keras-team/keras#20585): sum of squares over the global batch."""
    with strategy.scope():
        model = make_model(keras, kmp, policy, weights, seed)
        opt = keras.optimizers.AdamW(1e-2)
        if policy == "lean_bfloat16":  # KAHAN_INT8: its int8 buffer the broadcast refused
            opt = kmp.LeanOptimizer(opt, **KAHAN_INT8)
        opt.build(model.trainable_variables)
    init = [np.asarray(keras.ops.convert_to_numpy(v.value), "float32") for v in model.weights]
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(global_batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dist = strategy.experimental_distribute_dataset(dataset.with_options(options))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            err = tf.cast(model(xb, training=True), "float32") - yb
            loss = tf.reduce_sum(tf.square(err)) / (global_batch * WIDTH)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    for xb, yb in dist:
        step(xb, yb)
    return model, opt, init


def run_mirrored():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import keras_mp as kmp

    out = {}
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    local = mirrored.experimental_local_results
    for policy in ("lean_bfloat16", "mixed_bfloat16"):
        model, opt, init = tf_train(tf, keras, kmp, mirrored, policy)
        replicas = [
            [np.asarray(t, "float32").tolist() for t in local(v.value)]
            for v in model.trainable_variables + opt.variables
        ]
        ref_model, ref_opt, _ = tf_train(tf, keras, kmp, tf.distribute.get_strategy(), policy)
        out[policy] = {
            "distributed": listed(float32_weights(model, opt)),
            "single": listed(float32_weights(ref_model, ref_opt)),
            "init": listed(init[: len(model.trainable_variables)]),
            "replicas_agree": all(all(r == per[0] for r in per[1:]) for per in replicas),
            "replicas": mirrored.num_replicas_in_sync,
        }
    emit(out)


def run_multiworker():
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    import keras

    import keras_mp as kmp

    worker = int(os.environ["KERAS_MP_WORKER_INDEX"])
    out = {"worker": worker}
    for policy in ("lean_bfloat16", "mixed_bfloat16"):
        # Each worker draws other initial weights: the broadcast must make them the chief's.
        model, opt, init = tf_train(tf, keras, kmp, strategy, policy, seed=worker)
        state = [np.asarray(v.numpy(), "float32") for v in opt.variables]
        entry = {
            "weights": listed(float32_weights(model, opt)),
            "state": listed(state),
            "init": listed(init),
            "dtypes": sorted({str(v.dtype) for v in model.weights + opt.variables}),
        }
        if worker == 0:  # one device, the same global batches, from the chief's start
            ref_model, ref_opt, _ = tf_train(
                tf, keras, kmp, tf.distribute.get_strategy(), policy, weights=init
            )
            entry["single"] = listed(float32_weights(ref_model, ref_opt))
        out[policy] = entry
    emit(out)


# -- JAX ----------------------------------------------------------------------------------


def jax_train(keras, kmp, distribution, policy="lean_bfloat16", shard=False, process=None):
    from keras_mp.lean import sharding as lean_sharding

    keras.distribution.set_distribution(distribution)
    try:
        model = make_model(keras, kmp, policy)
        inner = keras.optimizers.AdamW(1e-2)
        if policy == "lean_bfloat16":
            opt = kmp.LeanOptimizer(inner, shard_over_data=shard, block_size=256, **KAHAN_INT8)
        else:
            opt = kmp.LossScaleOptimizer(inner) if policy == "mixed_float16" else inner
        model.compile(optimizer=opt, loss="mse")
        init = [np.asarray(v.value, "float32") for v in model.trainable_variables]
        x, y, batch = X, Y, BATCH
        if process is not None:  # each process feeds its half of every global batch
            index, count = process
            batch = BATCH // count
            rows = np.concatenate([
                np.arange(b * BATCH + index * batch, b * BATCH + (index + 1) * batch)
                for b in range(STEPS)
            ])
            x, y = X[rows], Y[rows]
        model.fit(x, y, batch_size=batch, shuffle=False, epochs=1, verbose=0)
        params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        optimizer = opt.inner_optimizer if hasattr(opt, "inner_optimizer") else opt
        weights = lean_sharding.per_device_bytes(model.variables)
        state = lean_sharding.per_device_bytes(optimizer.variables)
        values = opt.weights_float32() if policy == "lean_bfloat16" else [
            v.value for v in model.trainable_variables
        ]
        if process is not None:
            from jax.experimental import multihost_utils

            values = [multihost_utils.process_allgather(v, tiled=True) for v in values]
        return {
            "weights": listed(np.asarray(v, "float32") for v in values),
            "init": listed(init),
            "weight_bytes": max(weights.values()) / params,
            "state_bytes": max(state.values()) / params,
            "devices": len(state),
        }
    finally:
        keras.distribution.set_distribution(None)


def layout_map(keras, devices, shape):
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    layouts = keras.distribution.LayoutMap(mesh)
    layouts["up/kernel"] = (None, "model")
    layouts["up/bias"] = ("model",)
    layouts["down/kernel"] = ("model", None)
    layouts["head/kernel"] = (None, "model")
    return layouts


def run_jax():
    import jax
    import keras

    import keras_mp as kmp

    devices = jax.devices()
    assert len(devices) == 4
    dp = keras.distribution.DataParallel(devices=devices)
    mp = keras.distribution.ModelParallel(
        layout_map=layout_map(keras, devices, (1, 4)), batch_dim_name="batch"
    )
    mp2 = keras.distribution.ModelParallel(
        layout_map=layout_map(keras, devices, (2, 2)), batch_dim_name="batch"
    )
    out = {
        "single": jax_train(keras, kmp, None),
        "data_parallel": jax_train(keras, kmp, dp),
        "data_parallel_split": jax_train(keras, kmp, dp, shard=True),
        "model_parallel": jax_train(keras, kmp, mp),
        "model_parallel_2x2_split": jax_train(keras, kmp, mp2, shard=True),
        "mixed_single": jax_train(keras, kmp, None, "mixed_bfloat16"),
        "mixed_data_parallel": jax_train(keras, kmp, dp, "mixed_bfloat16"),
        "mixed_model_parallel": jax_train(keras, kmp, mp, "mixed_bfloat16"),
    }
    emit(out)


def run_jax_process(index: int, port: int):
    import jax
    import keras

    keras.distribution.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=index)
    import keras_mp as kmp

    devices = jax.devices()
    assert len(devices) == 4 and jax.local_device_count() == 2
    out = {"process": index}
    for name, distribution, shard in [
        ("data_parallel_split", keras.distribution.DataParallel(devices=devices), True),
        ("model_parallel_split", keras.distribution.ModelParallel(
            layout_map=layout_map(keras, devices, (2, 2)), batch_dim_name="batch"), True),
    ]:
        distribution.auto_shard_dataset = False  # each process feeds its own rows
        out[name] = jax_train(keras, kmp, distribution, shard=shard, process=(index, 2))
    emit(out)


if __name__ == "__main__":
    if MODE == "jax_process":
        run_jax_process(int(sys.argv[2]), int(sys.argv[3]))
    else:
        {"mirrored": run_mirrored, "multiworker": run_multiworker, "jax": run_jax}[MODE]()
