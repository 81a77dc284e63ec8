"""No non-finite step reaches the weights under any policy, and every skip is counted
(issue 46 part 2): the fixed scale of 1 compile gives bfloat16 and float32 models, the lean
optimizer's skip counter, NonFiniteGuard on non-finite weights, and converting a lean model
back to float32 master weights."""

import warnings

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import keras_mp as kmp

BATCH = 32
BAD_BATCH = 3  # the batch holding the NaN row


def _digits(n=256, nan=True):
    x, y = load_digits(return_X_y=True)
    x, y = (x[:n] / 16).astype("float32"), (y[:n] % 2).astype("int32")
    if nan:
        x[BAD_BATCH * BATCH + 5, 7] = np.nan
    return x, y


def _mlp(name="mlp"):
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(2, name="logits"),
        ],
        name=name,
    )


def _numpy(variables):
    return [keras.ops.convert_to_numpy(v.value).copy() for v in variables]


class _Snapshots(keras.callbacks.Callback):
    """The trainable weights and the optimizer's variables after every batch."""

    def __init__(self):
        super().__init__()
        self.weights, self.slots = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(_numpy(self.model.trainable_variables))
        self.slots.append(_numpy(self.model.optimizer.variables))


def _model_under(how: str) -> keras.Model:
    if how == "kmp_global":
        kmp.set_global_policy("mixed_bfloat16")
        return _mlp()
    if how == "keras_global":  # Keras' own spelling, keras_mp imported (issue 47.1)
        keras.config.set_dtype_policy("mixed_bfloat16")
        return _mlp()
    return kmp.convert(_mlp(), how)


@pytest.mark.parametrize("how", ["kmp_global", "keras_global", "mixed_bfloat16", "float32"])
def test_a_nan_sample_changes_no_weight_and_is_counted(how):
    model = _model_under(how)
    model.compile("adam", loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    snaps = _Snapshots()
    x, y = _digits()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[kmp.callbacks.LossScaleMonitor(), snaps],
    )
    opt = model.optimizer
    assert isinstance(opt, kmp.LossScaleOptimizer) and opt.skip_only
    assert history.history["skipped_steps"] == [1]
    assert "loss_scale" not in history.history  # a fixed 1: nothing to log
    for w in model.trainable_variables:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(w.value))), w.path
    # The NaN step changed no weight and no optimizer slot (its counters aside) ...
    for a, b in zip(snaps.weights[BAD_BATCH - 1], snaps.weights[BAD_BATCH], strict=True):
        np.testing.assert_array_equal(a, b)
    inner = [id(v) for v in opt.inner_optimizer.variables]
    for v, a, b in zip(opt.variables, snaps.slots[BAD_BATCH - 1], snaps.slots[BAD_BATCH]):
        if id(v) in inner:
            np.testing.assert_array_equal(a, b, err_msg=v.path)
    # ... and the others trained.
    assert not np.array_equal(snaps.weights[BAD_BATCH][0], snaps.weights[BAD_BATCH + 1][0])
    assert int(keras.ops.convert_to_numpy(opt.iterations.value)) == len(x) // BATCH - 1


def test_skip_only_scaler_applies_gradients_as_they_are():
    """A finite step under the fixed scale of 1 is bit-identical to the plain optimizer's."""
    x, y = _digits(64, nan=False)
    results = []
    for wrap in (False, True):
        keras.utils.set_random_seed(3)
        model = _mlp()
        opt = keras.optimizers.Adam(1e-2)
        if wrap:
            opt = kmp.LossScaleOptimizer(opt, initial_scale=1.0, dynamic=False)
        model.compile(opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "loss never scaled" warning either
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        results.append(_numpy(model.trainable_variables))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_plain_float32_model_without_keras_mp_policy_keeps_its_optimizer():
    model = _mlp()
    model.compile("adam", loss="mse")
    assert type(model.optimizer) is keras.optimizers.Adam
    converted = kmp.convert(_mlp("c"), "mixed_bfloat16")
    converted.compile("adam", loss="mse", auto_scale_loss=False)
    assert type(converted.optimizer) is keras.optimizers.Adam


def test_collapse_guard_does_not_fire_on_the_fixed_scale_of_one():
    model = kmp.convert(_mlp(), "mixed_bfloat16")
    model.compile("adam", loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    guard = kmp.callbacks.CollapseGuard(patience=2, action="raise")
    x, y = _digits(nan=False)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[guard])
    assert guard.diagnosis is None and guard.idle_reason is None


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_converting_a_lean_model_gives_float32_master_weights(policy):
    if policy == "mixed_float16" and keras.backend.backend() == "jax":
        pytest.skip("JAX on CPU has no float16 dot")
    x, y = _digits(64, nan=False)
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    lean = kmp.convert(_mlp(), "lean_bfloat16")
    lean.compile("adam", loss=loss)
    lean.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    trained = _numpy(lean.trainable_variables)
    assert {str(v.dtype) for v in lean.trainable_variables} == {"bfloat16"}

    new = kmp.convert(lean, policy)
    assert {str(v.dtype) for v in new.trainable_variables} == {"float32"}
    for a, w in zip(trained, new.trainable_variables, strict=True):
        np.testing.assert_array_equal(a.astype("float32"), keras.ops.convert_to_numpy(w.value))
    # compiled like the lean model, with the plain optimizer the policy wraps as its own
    assert isinstance(new.optimizer, kmp.LossScaleOptimizer)
    assert type(new.optimizer.inner_optimizer) is keras.optimizers.Adam
    new.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    kernel = keras.ops.convert_to_numpy(new.get_layer("hidden").kernel.value)
    assert kernel.dtype == np.float32
    as_bf16 = keras.ops.convert_to_numpy(keras.ops.cast(kernel, "bfloat16")).astype("float32")
    assert np.mean(kernel != as_bf16) > 0.5  # moved in float32, off bfloat16's grid


def test_lean_skipped_step_is_counted_where_float16_counts_its_skips():
    model = kmp.convert(_mlp(), "lean_bfloat16")
    model.compile("adam", loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert isinstance(model.optimizer, kmp.LeanOptimizer)
    snaps = _Snapshots()
    x, y = _digits()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[kmp.callbacks.LossScaleMonitor(), snaps],
    )
    assert history.history["skipped_steps"] == [1] and "loss_scale" not in history.history
    assert history.history["overflow_rate"] == [1 / (len(x) // BATCH)]
    assert int(keras.ops.convert_to_numpy(model.optimizer.skipped_steps.value)) == 1
    for a, b in zip(snaps.weights[BAD_BATCH - 1], snaps.weights[BAD_BATCH], strict=True):
        np.testing.assert_array_equal(a, b)
    for w in model.trainable_variables:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(w.value).astype("float32")))


@pytest.mark.parametrize("every", [None, 1])
def test_nonfinite_guard_notices_nonfinite_weights_with_a_finite_loss(every):
    """A stock optimizer lets the NaN step through (no keras_mp policy in sight)."""
    model = _mlp()
    model.compile("adam", loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert type(model.optimizer) is keras.optimizers.Adam
    guard = kmp.callbacks.NonFiniteGuard(patience=100, check_weights_every=every)
    x, y = _digits()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.stopped_step == (BAD_BATCH + 1 if every else len(x) // BATCH)
    assert guard.diagnosis.startswith(f"Non-finite weights at step {guard.stopped_step}")
    assert "hidden/kernel" in guard.diagnosis
    assert model.stop_training


def test_nonfinite_guard_stays_quiet_when_the_step_was_skipped():
    kmp.set_global_policy("mixed_bfloat16")
    model = _mlp()
    model.compile("adam", loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    guard = kmp.callbacks.NonFiniteGuard(check_weights_every=1, action="raise")
    x, y = _digits()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[guard])
    assert guard.diagnosis is None


def test_skip_only_scaler_is_saved_and_gives_way_to_float16s_on_convert(tmp_path):
    model = kmp.convert(_mlp(), "mixed_bfloat16")
    model.compile("adam", loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _digits()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Skipping variable loading for optimizer"
        loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is kmp.LossScaleOptimizer and loaded.optimizer.skip_only
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.skipped_steps.value)) == 1
    if keras.backend.backend() == "jax":
        return  # JAX on CPU has no float16 dot
    half = kmp.convert(model, "mixed_float16")
    assert type(half.optimizer) is kmp.LossScaleOptimizer
    assert half.optimizer.dynamic and not half.optimizer.skip_only
