"""A learning rate far too high is caught under every policy and named; a float16 range
problem is told apart from it and named by its layer (issue 52)."""

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.observe.divergence import LossTrend


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(16, 4)), -1)
    return x, y


def _model(policy, lr):
    keras.utils.set_random_seed(0)
    base = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(4),
        ]
    )
    model = kmp.convert(base, policy)
    model.compile(
        keras.optimizers.Adam(lr), kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "lean_bfloat16", "float32"])
def test_a_learning_rate_blow_up_is_stopped_and_named_without_float16(policy):
    x, y = _data()
    model = _model(policy, 1e3)
    guard = kmp.callbacks.DivergenceGuard()
    collapse = kmp.callbacks.CollapseGuard()
    model.fit(x, y, batch_size=32, epochs=10, verbose=0, callbacks=[collapse, guard])
    # 80 steps without the guards; the guards stop within the patience (10) + a few steps
    assert guard.stopped_step is not None and guard.stopped_step <= 20
    assert guard.cause == "learning_rate"
    assert "the learning rate (1000) is too high" in guard.diagnosis
    assert "warmup" in guard.diagnosis and "clipnorm" in guard.diagnosis
    # CollapseGuard runs the same check by default (it judged only skip rates before)
    assert collapse.stopped_step == guard.stopped_step
    assert collapse.cause == "learning_rate"


def test_float16_collapse_from_a_learning_rate_blames_the_learning_rate():
    x, y = _data()
    guards = [
        kmp.callbacks.CollapseGuard(divergence=False),
        kmp.callbacks.NonFiniteGuard(patience=3, diagnose_data=(x[:32], y[:32])),
    ]
    for guard in guards:
        _model("mixed_float16", 1e3).fit(
            x, y, batch_size=32, epochs=10, verbose=0, callbacks=[guard]
        )
        assert guard.diagnosis is not None, type(guard).__name__
        assert guard.cause == "learning_rate"
        assert "the learning rate (1000) is too high" in guard.diagnosis
        assert "train with 'mixed_bfloat16'" not in guard.diagnosis
        assert "x what it was since training began" in guard.diagnosis


def test_collapse_from_an_adapted_normalization_names_it_and_calibrate():
    rng = np.random.default_rng(0)
    x = rng.uniform(1e4, 1e5, size=(256, 8)).astype("float32")
    y = (x[:, 0] > 5e4).astype("int32")
    norm = keras.layers.Normalization(name="scaler")
    norm.adapt(x)
    base = keras.Sequential(
        [keras.Input((8,)), norm, keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    # The default keep-list now pins an adapted Normalization to float32 (issue 52), so the
    # overflow comes back only with a keep-list that leaves it out, as a user's may
    policy = kmp.Policy("mixed_float16", keep_fp32=("softmax", "output"))
    model = kmp.convert(base, policy, check=None)
    assert model.get_layer("scaler").compute_dtype == "float16"
    model.compile(
        keras.optimizers.Adam(1e-3), kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    guard = kmp.callbacks.CollapseGuard()
    model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[guard])
    assert guard.stopped_step is not None
    assert guard.cause == "range"
    assert "'scaler' (Normalization: variance up to" in guard.diagnosis
    assert "calibrate=" in guard.diagnosis
    assert "dense" not in guard.diagnosis  # the layers downstream are not blamed


def test_healthy_training_is_left_alone():
    x, y = _data()
    model = _model("mixed_bfloat16", 1e-2)
    guard = kmp.callbacks.DivergenceGuard()
    history = model.fit(x, y, batch_size=16, epochs=12, verbose=0, callbacks=[guard])
    assert guard.stopped_step is None
    assert len(history.history["loss"]) == 12
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]


def test_loss_trend_ignores_noise_near_zero_and_handles_negative_losses():
    trend = LossTrend()
    values = [2.0] + [0.01] * 20 + [0.04] * 20  # 4x its best, but 2% of the way back
    assert not any(trend.update(i, v) for i, v in enumerate(values))
    trend = LossTrend()  # a negative loss (cosine similarity) that gets worse
    values = [-0.9] * 10 + [-0.95] * 10 + [1.5] * 5
    flags = [trend.update(i, v) for i, v in enumerate(values)]
    assert not any(flags[:20]) and all(flags[20:])


def test_divergence_guard_validates_and_round_trips():
    with pytest.raises(ValueError, match="`factor` must be a number > 1"):
        kmp.callbacks.DivergenceGuard(factor=1.0)
    guard = kmp.callbacks.DivergenceGuard(patience=4, action="raise")
    again = kmp.callbacks.DivergenceGuard.from_config(guard.get_config())
    assert again.get_config() == guard.get_config()


def test_divergence_guard_alone_fires_under_async_dispatch():
    """Alone (verbose=0) the guard is dispatched on Keras' worker thread where the backend
    allows it (JAX): steps may arrive out of order, and it must still fire."""
    x, y = _data()
    guard = kmp.callbacks.DivergenceGuard()
    _model("mixed_bfloat16", 1e3).fit(x, y, batch_size=32, epochs=10, verbose=0, callbacks=[guard])
    assert guard.cause == "learning_rate" and guard.stopped_step <= 40


# -------------------------------------------------- fit's default check (issue 52, H6)


def _fit_warnings(model, x, y, **kwargs):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=32, epochs=4, verbose=0, **kwargs)
    words = [str(w.message) for w in seen if "divergence check" in str(w.message)]
    return history, words


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "lean_bfloat16"])
def test_fit_warns_of_a_divergence_with_no_callback_and_runs_on(policy):
    """Harness finding H6: lr 1e3 under bfloat16 ran all its steps to chance accuracy with
    no word when `fit` had no keras_mp callback. fit's default check warns once, naming the
    learning rate, and changes nothing: all 4 epochs (32 steps) run."""
    x, y = _data()
    history, words = _fit_warnings(_model(policy, 1e3), x, y)
    assert len(history.history["loss"]) == 4
    assert len(words) == 1, words
    assert "the learning rate (1000) is too high" in words[0]
    assert "KERAS_MP_FIT_GUARD=0" in words[0] and "DivergenceGuard()" in words[0]


def test_fit_default_check_leaves_float32_own_guards_and_opt_out(monkeypatch):
    x, y = _data()
    # float32: Keras' fit as it is
    assert _fit_warnings(_model("float32", 1e3), x, y)[1] == []
    # the user's own guard stops the run; no second word from the default one
    guard = kmp.callbacks.DivergenceGuard()
    history, words = _fit_warnings(_model("mixed_bfloat16", 1e3), x, y, callbacks=[guard])
    assert guard.stopped_step is not None and len(history.history["loss"]) < 4
    assert words == []
    monkeypatch.setenv("KERAS_MP_FIT_GUARD", "0")
    assert _fit_warnings(_model("mixed_bfloat16", 1e3), x, y)[1] == []


def test_fit_default_check_is_quiet_on_healthy_training():
    x, y = _data()
    history, words = _fit_warnings(_model("mixed_bfloat16", 1e-2), x, y)
    assert words == []
    assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
