"""Subprocess side of tests/test_distribute.py (device flags must precede TF/JAX start-up).

    python tests/_distribute_worker.py mirrored      # 2 logical CPUs, MirroredStrategy
    python tests/_distribute_worker.py multiworker   # one MultiWorkerMirroredStrategy worker
    python tests/_distribute_worker.py jax           # 2 host devices, keras.distribution

Every mode trains the same tiny model on the same 3 global batches of 8 rows; row 15
(second half of batch 1) holds a NaN, so only the second replica's shard of that batch is
non-finite. The last stdout line is a JSON object with what the test asserts on.
"""

import json
import os
import sys

MODE = sys.argv[1]
os.environ["KERAS_BACKEND"] = "jax" if MODE == "jax" else "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if MODE == "jax":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import numpy as np  # noqa: E402

GLOBAL_BATCH, STEPS, NAN_ROW = 8, 3, 15
_rng = np.random.default_rng(0)
X = _rng.normal(size=(GLOBAL_BATCH * STEPS, 4)).astype("float32")
Y = _rng.normal(size=(GLOBAL_BATCH * STEPS, 1)).astype("float32")
X[NAN_ROW, 0] = np.nan


def make_model_and_optimizer(keras, kmp, weights=None):
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(4, name="hidden"),
        keras.layers.Dense(1, dtype="float32", name="out"),
    ])
    if weights is not None:
        model.set_weights(weights)
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), initial_scale=2.0**4)
    opt.build(model.trainable_variables)
    return model, opt


def emit(result):
    print(json.dumps(result), flush=True)


# -- TensorFlow ---------------------------------------------------------------------------


def tf_per_replica(strategy, variables):
    """Per variable, the value each local replica holds."""
    return [
        [np.asarray(t).tolist() for t in strategy.experimental_local_results(v.value)]
        for v in variables
    ]


def tf_custom_step(tf, strategy, model, opt, jit_compile=False):
    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            err = model(xb, training=True) - yb
            loss = tf.reduce_sum(tf.square(err)) / GLOBAL_BATCH  # global-batch mean
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    if jit_compile:
        replica_step = tf.function(replica_step, jit_compile=True)

    @tf.function
    def step(xb, yb):
        strategy.run(replica_step, args=(xb, yb))

    return step


def tf_reference(tf, keras, kmp, weights):
    """Single device, plain model.fit on the same global batches."""
    model, opt = make_model_and_optimizer(keras, kmp, weights)
    model.compile(optimizer=opt, loss="mse")
    model.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, epochs=1, verbose=0)
    return [np.asarray(v.numpy()).tolist() for v in model.variables + opt.variables]


def jit_error(fn):
    from keras_mp.tf.distribute import UnsupportedJitCompileError

    try:
        fn()
    except UnsupportedJitCompileError as e:
        return str(e)
    return None


def run_mirrored():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import keras_mp as kmp

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    init = make_model_and_optimizer(keras, kmp)[0].get_weights()
    out = {"reference": tf_reference(tf, keras, kmp, init)}
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    dist = strategy.experimental_distribute_dataset(dataset)
    out["nan_in_shard"] = [
        [bool(np.isnan(np.asarray(t)).any()) for t in strategy.experimental_local_results(xb)]
        for xb, _ in dist
    ]

    with strategy.scope():  # model.fit
        model, opt = make_model_and_optimizer(keras, kmp, init)
        model.compile(optimizer=opt, loss="mse", jit_compile=False)
    history = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: history.append(
            tf_per_replica(strategy, model.variables + opt.variables)
        )
    )
    model.fit(dataset, epochs=1, verbose=0, callbacks=[record])
    out["fit"] = history

    with strategy.scope():  # custom loop
        model, opt = make_model_and_optimizer(keras, kmp, init)
    step = tf_custom_step(tf, strategy, model, opt)
    history = []
    for xb, yb in dist:
        step(xb, yb)
        history.append(tf_per_replica(strategy, model.variables + opt.variables))
    out["custom"] = history

    # jit_compile=True: a clear error at trace time, and nothing written.
    with strategy.scope():
        model, opt = make_model_and_optimizer(keras, kmp, init)
        model.compile(optimizer=opt, loss="mse", jit_compile=True)
    out["fit_jit_error"] = jit_error(lambda: model.fit(dataset, epochs=1, verbose=0))
    step = tf_custom_step(tf, strategy, model, opt, jit_compile=True)
    out["custom_jit_error"] = jit_error(lambda: step(*next(iter(dist))))
    out["after_jit_error"] = tf_per_replica(strategy, model.variables + opt.variables)
    out["names"] = [v.path for v in model.variables + opt.variables]
    out["init"] = [w.tolist() for w in init]
    emit(out)


def run_multiworker():
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
    import keras

    import keras_mp as kmp

    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    init = make_model_and_optimizer(keras, kmp)[0].get_weights()
    out = {"worker": int(os.environ["KERAS_MP_WORKER_INDEX"])}
    if out["worker"] == 0:  # the test compares worker 0 with it
        out["reference"] = tf_reference(tf, keras, kmp, init)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dist = strategy.experimental_distribute_dataset(dataset.with_options(options))
    with strategy.scope():
        model, opt = make_model_and_optimizer(keras, kmp, init)
    step = tf_custom_step(tf, strategy, model, opt)
    history, nan_seen = [], []
    for xb, yb in dist:
        nan_seen.append(bool(np.isnan(np.asarray(strategy.experimental_local_results(xb)[0])).any()))
        step(xb, yb)
        history.append(tf_per_replica(strategy, model.variables + opt.variables))
    out["nan_in_shard"], out["custom"] = nan_seen, history
    out["names"] = [v.path for v in model.variables + opt.variables]
    step = tf_custom_step(tf, strategy, model, opt, jit_compile=True)
    out["custom_jit_error"] = jit_error(lambda: step(*next(iter(dist))))
    emit(out)


# -- JAX ----------------------------------------------------------------------------------


def run_jax():
    import jax
    import keras

    import keras_mp as kmp

    devices = jax.devices()
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    init = make_model_and_optimizer(keras, kmp)[0].get_weights()
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")  # split over the 2 devices
    out = {"devices": [str(d) for d in devices]}
    for name, distribution in [
        ("data_parallel", keras.distribution.DataParallel(devices=devices)),
        ("model_parallel", keras.distribution.ModelParallel(layout_map=layout_map)),
        ("single", None),
    ]:
        keras.distribution.set_distribution(distribution)
        model, opt = make_model_and_optimizer(keras, kmp, init)
        model.compile(optimizer=opt, loss="mse")
        history = []
        for b in range(STEPS):  # one fit per batch: JAX syncs variables at the end of fit
            rows = slice(b * GLOBAL_BATCH, (b + 1) * GLOBAL_BATCH)
            model.fit(X[rows], Y[rows], batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
            history.append([
                [np.asarray(s.data).tolist() for s in v.value.addressable_shards]
                for v in model.variables + opt.variables
            ])
        out[name] = history
        out["names"] = [v.path for v in model.variables + opt.variables]
        if distribution is not None:
            layout = distribution.get_data_layout((GLOBAL_BATCH, 4))
            sharded = jax.device_put(X[GLOBAL_BATCH : 2 * GLOBAL_BATCH], layout.backend_layout)
            out[name + "_nan_in_shard"] = [
                bool(np.isnan(np.asarray(s.data)).any()) for s in sharded.addressable_shards
            ]
    keras.distribution.set_distribution(None)
    emit(out)


if __name__ == "__main__":
    {"mirrored": run_mirrored, "multiworker": run_multiworker, "jax": run_jax}[MODE]()
