"""LossScaleMonitor, CollapseGuard and NonFiniteGuard inside real `model.fit` runs."""

import csv
import importlib.util

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.observe.callbacks import CollapseGuard, LossScaleMonitor, NonFiniteGuard


class SqrtGain(keras.layers.Layer):
    """y = x * sqrt(gain) with gain = 0: d/dgain is non-finite, d/dx is 0 (finite)."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="zeros", name="gain")

    def call(self, x):
        return x * keras.ops.sqrt(self.gain)


def _data(n=8, d=4):
    rng = np.random.default_rng(0)
    return rng.random((n, d), dtype="float32"), rng.random((n, d), dtype="float32")


def _inf_grad_model(optimizer):
    inp = keras.Input((4,))
    out = SqrtGain(name="sqrt_gain")(keras.layers.Dense(4, name="pre")(inp))
    model = keras.Model(inp, out)
    model.compile(optimizer=optimizer, loss="mse")
    return model


class SyncProbe(keras.callbacks.Callback):
    """Records, after each step, whether the JAX state was synced back to the model."""

    def on_train_begin(self, logs=None):
        self.flags = []

    def on_train_batch_end(self, batch, logs=None):
        self.flags.append(getattr(self._model, "_jax_state_synced", None))


def test_monitor_logs_are_the_optimizer_scale_step_by_step(tmp_path):
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=16.0, growth_interval=2)
    model.compile(optimizer=opt, loss="mse")
    every = LossScaleMonitor(log_dir=tmp_path, log_format="csv")
    sparse = LossScaleMonitor(every_n_steps=2)
    synced = SyncProbe()
    history = model.fit(
        x, y, batch_size=4, epochs=3, verbose=0, callbacks=[every, sparse, synced]
    )
    # On JAX the monitors read the live training state: no full state sync on any step.
    assert synced.flags == ([False] * 6 if keras.backend.backend() == "jax" else [None] * 6)
    # 2 steps per epoch, the scale doubles after every 2 finite steps.
    assert every.history["loss_scale"] == [16.0, 32.0, 32.0, 64.0, 64.0, 128.0]
    assert every.history["step"] == [1, 2, 3, 4, 5, 6]
    assert sparse.history["step"] == [2, 4, 6]
    assert sparse.history["loss_scale"] == [32.0, 64.0, 128.0]
    assert history.history["loss_scale"] == [32.0, 64.0, 128.0]
    assert history.history["skipped_steps"] == [0, 0, 0]
    assert history.history["overflow_rate"] == [0.0, 0.0, 0.0]
    assert float(keras.ops.convert_to_numpy(opt.dynamic_scale.value)) == 128.0
    with open(tmp_path / "loss_scale.csv") as f:
        rows = [(r["tag"], int(r["step"]), float(r["value"])) for r in csv.DictReader(f)]
    assert [v for tag, _, v in rows if tag == "loss_scale"] == every.history["loss_scale"]
    assert [v for tag, _, v in rows if tag == "epoch_loss_scale"] == [32.0, 64.0, 128.0]
    assert ("epoch_overflow_rate", 2, 0.0) in rows


@pytest.mark.parametrize("kind", ["keras_mp", "stock_keras"])
def test_collapse_guard_stops_within_patience_and_names_the_variable(kind):
    cls = kmp.LossScaleOptimizer if kind == "keras_mp" else keras.optimizers.LossScaleOptimizer
    model = _inf_grad_model(cls(keras.optimizers.SGD(0.1), initial_scale=16.0))
    before = [np.array(w) for w in model.get_weights()]
    x, y = _data()
    monitor, guard = LossScaleMonitor(), CollapseGuard(patience=3)
    history = model.fit(x, y, batch_size=8, epochs=20, verbose=0, callbacks=[monitor, guard])
    # Every step overflows: keras_mp's scale, never having held, backs off 1, 2, 3
    # halvings, 16 -> 8 -> 2 -> 1 (the floor), then sits at the floor for checks 3, 4, 5:
    # the guard stops at step 5, one step per epoch. Stock Keras halves once per step and
    # has no floor (the guard's floor is then 1): 16 -> 1 in 4 steps, stop at step 6.
    if kind == "keras_mp":
        scales, steps = [8.0, 2.0, 1.0, 1.0, 1.0], 5
    else:
        scales, steps = [8.0, 4.0, 2.0, 1.0, 0.5, 0.25], 6
    tail = scales[-1:]
    assert history.history["loss_scale"] == scales
    assert history.history["skipped_steps"] == list(range(1, steps + 1))
    assert history.history["overflow_rate"] == [1.0] * steps
    assert guard.stopped_step == steps and model.stop_training
    assert f"at its floor ({tail[-1]:g} <= 1) for 3 consecutive checks" in guard.diagnosis
    if kind == "keras_mp":
        assert "non-finite in the last overflow for: sqrt_gain/gain." in guard.diagnosis
        assert "pre/" not in guard.diagnosis
    for b, a in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # every step was skipped


def test_collapse_guard_skip_rate_raises_with_the_variable_names():
    model = _inf_grad_model(kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    x, y = _data()
    guard = CollapseGuard(patience=100, max_skip_rate=0.5, window=4, action="raise")
    with pytest.raises(kmp.LossScaleCollapseError, match="sqrt_gain/gain") as info:
        model.fit(x, y, batch_size=8, epochs=10, verbose=0, callbacks=[guard])
    assert "100% of the last 4 steps were skipped" in str(info.value)
    assert "loss scale now 32" in str(info.value)  # 2**15 halved 1 + 2 + 3 + 4 times
    assert guard.stopped_step == 4


def _overflow_model(kernel_value, dtype=None):
    """pre (identity) -> big (all weights `kernel_value`) -> logits, on inputs of ones."""
    inp = keras.Input((64,))
    h = keras.layers.Dense(64, kernel_initializer="identity", name="pre", dtype=dtype)(inp)
    h = keras.layers.Dense(
        32, activation="relu", name="big", dtype=dtype,
        kernel_initializer=keras.initializers.Constant(kernel_value),
    )(h)
    out = keras.layers.Dense(8, name="logits", dtype="float32")(h)
    return keras.Model(inp, out)


def test_nonfinite_guard_names_the_layer_overflowing_float32():
    # 64 * 1e37 = 6.4e38 exceeds float32's max: 'big' is the first non-finite output. The
    # loss scaler skips the bad steps, so the weights stay intact for the diagnosis.
    model = _overflow_model(1e37)
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x, y = np.ones((32, 64), "float32"), np.zeros((32, 8), "float32")
    guard = NonFiniteGuard(patience=2, diagnose_data=(x[:4], y[:4]))
    blind = NonFiniteGuard(patience=2)
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[guard, blind])
    assert guard.culprit == "big" and guard.stopped_step == 2
    assert "first layer with a non-finite output is 'big' (Dense" in guard.diagnosis
    assert len(history.history["loss"]) == 1 and not np.isfinite(history.history["loss"][0])
    assert blind.stopped_step == 2 and blind.culprit is None
    assert "Pass `diagnose_data=` (a training batch)" in blind.diagnosis


@pytest.mark.tf_only
def test_nonfinite_guard_names_the_layer_above_fp16_max():
    # Under mixed_float16, 'big' computes 64 * 2000 = 128000 > 65504: inf on every batch.
    model = _overflow_model(2000.0, dtype="mixed_float16")
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse", jit_compile=True)
    x, y = np.ones((32, 64), "float32"), np.zeros((32, 8), "float32")
    guard = NonFiniteGuard(patience=2, diagnose_data=x[:4])
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[guard])
    assert guard.culprit == "big" and guard.stopped_step == 2
    assert "'big' (Dense, compute dtype float16) — its float16 output exceeded 65504" in (
        guard.diagnosis
    )
    # ... and what calibrating on that batch would pin (measured on a float32 copy).
    assert "1 layer(s) running in float16 pass its range in float32: 'big' (max |output| = " \
        "128,000 > 16,376)" in guard.diagnosis
    assert "calibrate=[..., batch]" in guard.diagnosis
    # Both steps were skipped by the scaler: no weight moved, the scale backed off twice.
    assert int(opt.iterations.numpy()) == 0 and int(opt.skipped_steps.numpy()) == 2
    assert float(opt.dynamic_scale.numpy()) == 2.0**12  # 2**15 halved once, then twice


def test_nonfinite_guard_without_loss_scaler_reports_corrupted_weights():
    model = _overflow_model(1e37)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((16, 64), "float32"), np.zeros((16, 8), "float32")
    guard = NonFiniteGuard(patience=2, diagnose_data=x[:4])
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[guard])
    # Plain SGD applied the NaN step, so no layer can be blamed from the outputs any more.
    assert guard.stopped_step == 2 and guard.culprit is None
    assert "The weights are already non-finite (pre/kernel, pre/bias, big/kernel" in (
        guard.diagnosis
    )


@pytest.mark.tf_only
def test_monitor_writes_tensorboard_scalars(tmp_path):
    import tensorflow as tf

    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ImportError, match="needs the `tensorflow` and `tensorboard`"):
            LossScaleMonitor(log_dir=str(tmp_path), log_format="tensorboard")
        return
    x, y = _data()
    model = _inf_grad_model(kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[LossScaleMonitor(log_dir=str(tmp_path))])
    scalars = []
    for path in (tmp_path / "train").iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for v in event.summary.value:
                scalars.append((v.tag, event.step, float(tf.make_ndarray(v.tensor))))
    assert ("loss_scale", 1, 2.0) in scalars and ("loss_scale", 2, 1.0) in scalars
    assert ("epoch_overflow_rate", 0, 1.0) in scalars


BAD_ARGUMENTS = [
    (lambda: CollapseGuard(patience=0), "patience"),
    (lambda: CollapseGuard(min_scale=-1.0), "min_scale"),
    (lambda: CollapseGuard(max_skip_rate=1.5), "max_skip_rate"),
    (lambda: CollapseGuard(window=2.5), "window"),
    (lambda: CollapseGuard(action="warn"), "action"),
    (lambda: CollapseGuard(check_every=0), "check_every"),
    (lambda: LossScaleMonitor(every_n_steps=0), "every_n_steps"),
    (lambda: LossScaleMonitor(log_format="json"), "log_format"),
    (lambda: NonFiniteGuard(patience=-2), "patience"),
    (lambda: NonFiniteGuard(action="ignore"), "action"),
]


def test_bad_arguments_and_configs():
    for make, argument in BAD_ARGUMENTS:
        with pytest.raises(ValueError, match=f"`{argument}`"):
            make()
    guard = CollapseGuard(patience=4, min_scale=8.0, max_skip_rate=0.25, action="raise")
    assert CollapseGuard.from_config(guard.get_config()).get_config() == guard.get_config()
    monitor = LossScaleMonitor.from_config(LossScaleMonitor(every_n_steps=5).get_config())
    assert monitor.every_n_steps == 5
    # A float16 model without a LossScaleOptimizer is a mistake: a clear error at fit start.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, dtype="mixed_float16")])
    model.compile(optimizer="sgd", loss="mse", auto_scale_loss=False)
    for callback in (LossScaleMonitor(), CollapseGuard()):
        callback.set_model(model)
        with pytest.raises(ValueError, match="needs a model compiled with a LossScaleOptimizer"):
            callback.on_train_begin()


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "float32"])
def test_scale_callbacks_count_skips_where_no_loss_scaling_is_needed(policy, caplog):
    # Users switch precision with one flag and keep their callbacks: under a keras_mp
    # policy that needs no loss scaling, compile gives a fixed scale of 1 that only skips
    # non-finite steps, and the callbacks log its count like float16's.
    kmp.set_global_policy(policy)
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert model.optimizer.skip_only
    callbacks = [LossScaleMonitor(), CollapseGuard(action="raise", patience=1), NonFiniteGuard()]
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
    assert history.history["skipped_steps"] == [0, 0]
    assert history.history["overflow_rate"] == [0.0, 0.0]
    assert "loss_scale" not in history.history  # a fixed 1: nothing to log
    assert history.history["loss"][1] < history.history["loss"][0]
    assert callbacks[0].idle_reason is None and callbacks[1].diagnosis is None


def test_scale_callbacks_stand_aside_where_nothing_counts_skips(caplog):
    # A plain Keras float32 model (no keras_mp policy in sight) keeps its optimizer: the
    # scale callbacks add nothing, say why once, and never fail.
    from keras_mp.observe import telemetry as _telemetry

    _telemetry._said.clear()
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    callbacks = [LossScaleMonitor(), CollapseGuard(action="raise"), NonFiniteGuard()]
    with caplog.at_level("WARNING", logger="keras_mp"):
        first = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=callbacks)
        second = model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=callbacks)
    for history in (first, second):
        assert set(history.history) == {"loss"}
        assert np.all(np.isfinite(history.history["loss"]))
    assert first.history["loss"][1] < first.history["loss"][0]
    for callback in callbacks[:2]:
        assert "computes in float32" in callback.idle_reason
        assert "does nothing in this fit" in callback.idle_reason
    assert callbacks[0].history == {"step": [], "loss_scale": [], "skipped_steps": []}
    said = [r.getMessage() for r in caplog.records if "does nothing in this fit" in r.getMessage()]
    assert len(said) == 2  # once per callback kind, not once per fit
    assert not any("mixed_float16" in m for m in said)
