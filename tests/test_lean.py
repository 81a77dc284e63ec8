"""The lean training state: codecs, LeanOptimizer, the lean_bfloat16 policy."""

import warnings

import keras
import ml_dtypes
import numpy as np
import pytest
from _lean_helpers import data as _data
from _lean_helpers import mlp as _mlp
from _lean_helpers import np_
from _lean_helpers import train as _train
from keras import ops

import keras_mp as kmp
from keras_mp.lean import codecs

BACKEND = keras.backend.backend()


# -- codecs ------------------------------------------------------------------------------


def test_uniforms_are_independent_fields_of_one_hash():
    a, b, c = (np_(u) for u in codecs.uniforms((8192,), 5, 3))
    for u in (a, b, c):
        assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.02
        assert len(np.unique(u)) == 1024  # 10 bits
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.05 and abs(np.corrcoef(b, c)[0, 1]) < 0.05
    np.testing.assert_array_equal(a, np_(codecs.uniforms((8192,), 5, 1)[0]))


def test_random_bits_are_uniform_and_depend_on_seed():
    a = np_(codecs.random_bits((4096,), 1))
    b = np_(codecs.random_bits((4096,), 2))
    assert a.min() >= 0 and a.max() < 65536
    assert abs(a.mean() / 65536 - 0.5) < 0.02
    assert np.mean(a == b) < 0.01  # independent streams
    np.testing.assert_array_equal(a, np_(codecs.random_bits((4096,), 1)))  # deterministic


def test_stochastic_rounding_is_unbiased_and_hits_neighbours():
    x = np.full((20000,), 1.0 + 2.0**-9, "float32")  # a quarter ulp above 1.0 in bfloat16
    out = np_(codecs.stochastic_round_bfloat16(x, codecs.random_bits(x.shape, 7)))
    assert set(np.unique(out)) == {1.0, 1.0 + 2.0**-7}
    assert abs(out.mean() - x[0]) < 2e-4  # E[SR(x)] = x (nearest would give 1.0)
    assert abs(np.mean(out > 1.0) - 0.25) < 0.02
    inf = np.array([np.inf, -np.inf, np.nan], "float32")
    r = np_(codecs.stochastic_round_bfloat16(inf, codecs.random_bits(inf.shape, 0)))
    assert np.isposinf(r[0]) and np.isneginf(r[1]) and np.isnan(r[2])


@pytest.mark.parametrize("rounding,bound", [("kahan", 2.0**-15), ("kahan16", 2.0**-15)])
def test_kahan_encoding_keeps_about_16_bits(rounding, bound):
    rng = np.random.default_rng(0)
    target = (rng.normal(size=10000) * 10.0 ** rng.integers(-6, 3, size=10000)).astype("float32")
    w, c = codecs.encode_weight(target, rounding)
    assert keras.backend.standardize_dtype(w.dtype) == "bfloat16"
    back = np_(codecs.decode_weight(w, c, rounding))
    rel = np.abs(back - target) / np.abs(target)
    assert rel.max() < bound, rel.max()
    assert np.abs(np_(w) - target).max() > 0  # the bfloat16 weight alone is not exact


def test_small_updates_accumulate_under_kahan_not_under_nearest():
    # 1000 updates of 1e-4 on a weight of 1.0: each is 1/78 of a bfloat16 ulp (2**-7).
    w32 = np.ones((8,), "float32")
    w, c = codecs.encode_weight(w32, "kahan")
    nearest = ml_dtypes.bfloat16(1.0)
    for step in range(1000):
        target = codecs.decode_weight(w, c, "kahan") + 1e-4
        w, c = codecs.encode_weight(target, "kahan", codecs.uniforms((8,), step, 1)[0])
        nearest = ml_dtypes.bfloat16(np.float32(nearest) + np.float32(1e-4))
    assert float(nearest) == 1.0  # rounded away every time
    np.testing.assert_allclose(np_(codecs.decode_weight(w, c, "kahan")), 1.1, rtol=1e-3)
    np.testing.assert_allclose(np_(w), 1.1, rtol=2.0**-8)  # the weight itself moved too


def test_stochastic_weights_accumulate_in_expectation():
    w = ops.cast(ops.ones((4096,)), "bfloat16")
    for step in range(200):
        noise = codecs.uniforms((4096,), step, 1)[0]
        w, _ = codecs.encode_weight(ops.cast(w, "float32") + 1e-4, "stochastic", noise)
    assert abs(np_(w).mean() - 1.02) < 2e-3


@pytest.mark.parametrize("signed", [True, False])
def test_int8_moments_round_trip(signed):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 1000)).astype("float32") * np.logspace(-4, 0, 1000, dtype="float32")
    if not signed:
        x = x**2
    codes, scales = codecs.encode_moment(x, "int8", signed, codecs.uniforms(x.shape, 3, 1)[0], 256)
    assert keras.backend.standardize_dtype(codes.dtype) == "uint8"
    assert tuple(codes.shape) == (12, 250) and tuple(scales.shape) == (12,)  # equal blocks
    back = np_(codecs.decode_moment(codes, scales, "int8", signed, x.shape))
    big = np.abs(x) > 0.05 * np.abs(x).max()
    rel = np.abs(back - x)[big] / np.abs(x)[big]
    assert rel.max() < (0.1 if signed else 0.2), rel.max()
    assert np.all(np.sign(back) == np.sign(x)) or signed
    if not signed:
        assert np.all(back[x > 0] > 0)  # a non-zero second moment never decodes to 0


def test_int8_moments_follow_a_slow_average():
    # v <- 0.999 v + 0.001 g**2 with g**2 = 1 from v = 2: a change of 0.05% per step, far
    # below one code step; stochastic codes still follow the float32 average.
    v, exact = np.full((1, 4096), 2.0, "float32"), 2.0
    codes, scales = codecs.encode_moment(v, "int8", False)
    for step in range(1000):
        cur = codecs.decode_moment(codes, scales, "int8", False, v.shape)
        noise = codecs.uniforms(v.shape, step + 1, 3)[step % 3]
        codes, scales = codecs.encode_moment(cur * 0.999 + 0.001, "int8", False, noise)
        exact = exact * 0.999 + 0.001
    got = np_(codecs.decode_moment(codes, scales, "int8", False, v.shape)).mean()
    assert abs(got - exact) / exact < 0.03, (got, exact)


# -- LeanOptimizer -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
        lambda: keras.optimizers.Adam(1e-2),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        lambda: keras.optimizers.SGD(0.1),
    ],
    ids=["adamw", "adam", "sgd_nesterov", "sgd"],
)
def test_float32_weights_and_moments_match_keras(make):
    ref = _train(_mlp(), make())
    got = _train(_mlp(), kmp.LeanOptimizer(make(), moments="float32"))
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_int8_moments_stay_close_to_keras_adamw():
    ref = _train(_mlp(), keras.optimizers.AdamW(1e-3), steps=8)
    got = _train(_mlp(), kmp.LeanOptimizer(keras.optimizers.AdamW(1e-3), moments="int8"), steps=8)
    init = [np_(v.value) for v in _mlp().trainable_variables]
    for a, b, w0 in zip(ref, got, init):
        moved = np.abs(a - w0).max()
        assert np.abs(a - b).max() < 0.15 * moved + 1e-6


@pytest.mark.parametrize(
    "rounding,moments,bound",
    # 8 steps from the same weights: mean |lean - mixed| / mean |mixed - start| per variable,
    # measured on TF / JAX: kahan + int8 0.05, 0.01, 0.03, 0.00 (both); the default
    # stochastic + int4 0.31 / 0.30, 0.20 / 0.16, 0.21 / 0.21, 0.00 (its 4-bit moments take
    # most of it: kahan + int4 0.25, 0.20, 0.18; one run's stochastic roundings scatter
    # about sqrt(moved x ulp) around the expected weight)
    [("kahan", "int8", 0.2), (None, None, 0.4)],
    ids=["kahan-int8", "default"],
)
def test_bfloat16_weights_follow_mixed_bfloat16_training(rounding, moments, bound):
    ref = _train(kmp.convert(_mlp(), "mixed_bfloat16"), keras.optimizers.AdamW(1e-3), steps=8)
    model = kmp.convert(_mlp(), "lean_bfloat16")
    assert [v.dtype for v in model.trainable_variables] == ["bfloat16"] * 4
    if rounding is None:
        _train(model, "adamw", steps=8)  # the default state
    else:
        inner = keras.optimizers.AdamW(1e-3)
        _train(model, kmp.LeanOptimizer(inner, rounding=rounding, moments=moments), steps=8)
    opt = model.optimizer
    assert isinstance(opt, kmp.LeanOptimizer) and opt.kind == "adamw"
    default = ("stochastic", kmp.lean.DEFAULT_MOMENTS)  # a small model: int4's bits
    assert (opt.rounding, opt.moments) == (rounding or default[0], moments or default[1])
    exact = [np_(w) for w in opt.weights_float32()]
    init = [np_(v.value) for v in _mlp().trainable_variables]
    for a, b, w0 in zip(ref, exact, init):
        # same compute dtype; the weights differ by their initial rounding to bfloat16, the
        # weights' rounding and the quantized moments: a fraction of what 8 steps moved them
        assert np.abs(a - b).mean() < bound * np.abs(a - w0).mean()
    stored = [np_(v.value) for v in model.trainable_variables]
    offsets = [np.abs(b - v).max() for b, v in zip(exact, stored)]
    if rounding == "kahan":  # the compensation holds what bfloat16 lost
        assert any(o > 0 for o in offsets)
    else:  # no compensation: the float32 value is the stored bfloat16 one
        assert all(o == 0 for o in offsets)


def test_lean_state_bytes():
    model = kmp.convert(_mlp(), "lean_bfloat16")
    model.compile(optimizer="adamw", loss="mse")
    assert (model.optimizer.rounding, model.optimizer.moments) == (
        "stochastic", kmp.lean.DEFAULT_MOMENTS  # no tensor factored here: int4's bytes
    )
    lean = kmp.state_bytes(model)
    mixed = kmp.convert(_mlp(), "mixed_bfloat16")
    mixed.compile(optimizer="adamw", loss="mse")
    assert kmp.state_bytes(mixed).per_parameter >= 12.0
    n = lean.parameters
    assert n == 16 * 128 + 128 + 128 * 3 + 3
    opt = model.optimizer  # its step counter: int64 on TensorFlow, int32 on JAX; the rate;
    counters = sum(  # the skipped steps' counter
        np.dtype(v.dtype).itemsize for v in (opt.iterations, opt._learning_rate, opt.skipped_steps)
    )
    # the default: bfloat16 weights, no compensation, 4-bit moments (two codes a byte and
    # a float32 scale per 128 values; the 3-value bias keeps float32 moments)
    assert lean.weights == 2 * n and lean.compensation == 0
    assert lean.optimizer - counters == 2176 + 136 + 408 + 24, str(lean)  # 2 kernels, 2 biases
    assert lean.per_parameter == pytest.approx(3.07, abs=0.01)
    assert "bytes/parameter" in str(lean)
    # the default before 2026-12-03: an int8 compensation byte and 8-bit moments
    kahan = kmp.convert(_mlp(), "lean_bfloat16")
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(), rounding="kahan", moments="int8")
    kahan.compile(optimizer=opt, loss="mse")
    kahan.optimizer.build(kahan.trainable_variables)
    state = kmp.state_bytes(kahan)
    assert state.weights == 2 * n and state.compensation == n
    # 8-bit codes; the small variables' state packed (pack_small): a scale per 128 values
    assert state.optimizer - counters == 2 * (2560 + 4 * 20) + 24
    # (5.02 with a scale per 2048 values: every variable of this model is small)
    assert state.per_parameter == pytest.approx(5.07, abs=0.01)


def test_policy_names_and_keep_list():
    p = kmp.Policy("lean_bfloat16")
    assert (p.compute_dtype, p.variable_dtype, p.is_lean) == ("bfloat16", "bfloat16", True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "pure policy" warning for lean
        kmp.Policy("lean_bfloat16")
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32)(inputs)
    h = keras.layers.LayerNormalization()(h)
    outputs = keras.layers.Dense(3, activation="softmax")(h)
    model = kmp.convert(keras.Model(inputs, outputs), "lean_bfloat16")
    dtypes = {v.path.split("/")[0]: v.dtype for v in model.trainable_variables}
    assert dtypes[model.layers[1].name] == "bfloat16"
    assert dtypes[model.layers[-1].name] == "float32"  # softmax head pinned: float32 weights
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert isinstance(model.optimizer, kmp.LeanOptimizer)
    x, y = _data()
    model.fit(x, y, epochs=1, batch_size=16, verbose=0)
    assert model.layers[-1].kernel.dtype == "float32"


def test_global_policy_gives_lean_optimizer():
    kmp.set_global_policy("lean_bfloat16")
    model = _mlp(dtype=None)
    assert model.layers[1].kernel.dtype == "bfloat16"
    model.compile(optimizer="sgd", loss="mse")
    assert isinstance(model.optimizer, kmp.LeanOptimizer) and model.optimizer.kind == "sgd"


def test_stock_bfloat16_is_left_alone():
    keras.config.set_dtype_policy("bfloat16")  # no keras_mp policy in sight
    model = _mlp(dtype=None)
    model.compile(optimizer="adam", loss="mse")
    assert type(model.optimizer) is keras.optimizers.Adam


def test_bad_configurations_fail_with_clear_errors():
    with pytest.raises(ValueError, match="one plain Keras optimizer"):
        kmp.LeanOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop()))
    assert kmp.LeanOptimizer(keras.optimizers.Adam(amsgrad=True)).kind == "adam"  # general
    with pytest.raises(ValueError, match="rounding"):
        kmp.LeanOptimizer(keras.optimizers.Adam(), rounding="round")
    with pytest.raises(ValueError, match="moments"):
        kmp.LeanOptimizer(keras.optimizers.Adam(), moments="int2")
    with pytest.raises(ValueError, match="block_size"):
        kmp.LeanOptimizer(keras.optimizers.Adam(), block_size=0)
    with pytest.raises(ValueError, match="lean_float16|Valid names"):
        kmp.Policy("lean_float16")
    model = kmp.convert(_mlp(), "lean_bfloat16")
    model.compile(optimizer="rmsprop", loss="mse")  # the general path (test_lean_general)
    assert isinstance(model.optimizer, kmp.LeanOptimizer)
    with pytest.raises(ValueError, match="need no loss scaling"):
        model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse")


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_clipping_accumulation_and_ema(rounding):
    inner = keras.optimizers.AdamW(
        1e-3, global_clipnorm=0.1, use_ema=True, gradient_accumulation_steps=2
    )
    model = kmp.convert(_mlp(), "lean_bfloat16")
    opt = kmp.LeanOptimizer(inner, rounding=rounding)
    before = [np_(v.value) for v in model.trainable_variables]
    _train(model, opt, steps=4)
    averages = [a for a in opt._model_variables_moving_average if a is not None]
    assert all(a.dtype == "float32" for a in averages)
    assert all(a.dtype == "float32" for a in opt._accumulated_gradients)
    after = [np_(v.value) for v in model.trainable_variables]
    assert all(np.isfinite(a).all() for a in after)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(after, before))
    # 4 steps, 2 applied updates clipped to a global norm of 0.1 at lr 1e-3: small moves
    assert max(np.abs(a - b).max() for a, b in zip(after, before)) < 0.01


@pytest.mark.parametrize("jit", [False, True])
def test_fit_with_and_without_xla(jit):
    model = kmp.convert(_mlp(), "lean_bfloat16")
    x, y = _data(256)
    model.compile(
        optimizer="adam",
        loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit,
    )
    hist = model.fit(x, y, epochs=4, batch_size=32, verbose=0).history["loss"]
    assert hist[-1] < 0.8 * hist[0]


def test_save_load_and_resume_bit_identical(tmp_path):
    # kahan + int8 (the compensation buffer saved and resumed); the default stochastic +
    # int4 state: tests/test_lean_int4.py::test_int4_config_save_load_and_resume_...
    x, y = _data(64)
    model = kmp.convert(_mlp(), "lean_bfloat16")
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(), rounding="kahan", moments="int8")
    model.compile(optimizer=opt, loss=loss)
    for i in range(3):
        model.train_on_batch(x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8])
    path = str(tmp_path / "lean.keras")
    model.save(path)
    loaded = kmp.saving.load_model(path)
    assert isinstance(loaded.optimizer, kmp.LeanOptimizer)
    assert [v.dtype for v in loaded.trainable_variables] == ["bfloat16"] * 4
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        assert a.dtype == b.dtype and a.path == b.path
        np.testing.assert_array_equal(np_(a.value), np_(b.value))
    for m in (model, loaded):
        for i in range(3, 6):
            m.train_on_batch(x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8])
    for a, b in zip(model.trainable_variables, loaded.trainable_variables):
        np.testing.assert_array_equal(np_(a.value), np_(b.value))
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(np_(a.value), np_(b.value))


def test_keras_hub_gpt2_trains_lean():
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=16,
    )
    model = kmp.convert(backbone, "lean_bfloat16")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(32, 16)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    y = np.zeros((32, 16, 32), "float32")
    model.compile(optimizer="adamw", loss="mse")
    assert isinstance(model.optimizer, kmp.LeanOptimizer)
    hist = model.fit(x, y, epochs=3, batch_size=8, verbose=0).history["loss"]
    assert np.isfinite(hist).all() and hist[-1] < hist[0]
    low = [v for v in model.trainable_variables if v.dtype == "bfloat16"]
    assert len(low) > len(model.trainable_variables) // 2
    # stochastic + int4 (the default); 19,712 parameters, so the small tensors' float32
    # moments weigh more than on a larger model (3.06 there, tests/test_lean_int4.py)
    # (and each small variable's moments padded to whole blocks of 128 in its packed group)
    assert kmp.state_bytes(model).per_parameter <= 3.32


@pytest.mark.tf_only
@pytest.mark.slow  # CI time (2026-12-06): runs with -m slow
def test_mirrored_strategy_keeps_each_variables_own_state():
    """Under a tf.distribute strategy every variable is updated from its own compensation
    and moments. A transformer has many variables of one shape and dtype (its norms'
    gamma and beta, the attention biases): one replica must give one device's bits."""
    import tensorflow as tf

    keras_hub = pytest.importorskip("keras_hub")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(16, 8)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    y = rng.normal(size=(16, 8, 32)).astype("float32")

    def train(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32,
                intermediate_dim=64, max_sequence_length=8,
            )
            model = kmp.convert(backbone, "lean_bfloat16")
            model.compile(optimizer=keras.optimizers.AdamW(1e-2), loss="mse")
        w0 = [np_(v.value) for v in model.trainable_variables]
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return [np_(w) for w in model.optimizer.weights_float32()], w0

    single, w0 = train(tf.distribute.get_strategy())
    mirrored, _ = train(tf.distribute.MirroredStrategy(["/cpu:0"]))
    shapes = [w.shape for w in w0]
    assert len(shapes) - len(set(shapes)) >= 10  # many variables share a shape
    for a, b, start in zip(mirrored, single, w0):
        assert np.abs(b - start).max() > 0  # every variable trained
        np.testing.assert_array_equal(a, b)


def test_audit_reports_the_training_state():
    model = kmp.convert(_mlp(), "lean_bfloat16")
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adamw", loss=loss)
    x, y = _data(16)
    model.fit(x, y, verbose=0)
    report = kmp.audit(model, (x, y))
    state = report.to_dict()["state_bytes"]
    assert state["per_parameter"] == pytest.approx(kmp.state_bytes(model).per_parameter, 1e-3)
    assert state["per_parameter"] <= 3.1  # stochastic + int4: 3.075 on this MLP
    assert "training state:" in str(report)
    assert all(r.fp32_reason != "model output" for r in report.layers)  # lean's logits are fine
    fresh = kmp.convert(_mlp(), "mixed_bfloat16")
    fresh.compile(optimizer="adam", loss="mse")
    kmp.audit(fresh, x)
    assert not fresh.optimizer.built  # the audit builds nothing


def test_non_finite_gradients_change_nothing_and_calibration_and_guard_work():
    x, y = _data(64)
    model = kmp.convert(_mlp(), "lean_bfloat16", calibrate=x[:32])
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss)
    model.train_on_batch(x[:8], y[:8])
    opt = model.optimizer
    state = lambda: {v.path: np_(v.value) for v in model.trainable_variables + opt.variables}
    before = state()
    bad = x[8:16].copy()
    bad[0, 0] = np.nan  # the first kernel's gradient is NaN whatever ReLU does with NaN
    model.train_on_batch(bad, y[8:16])  # the first kernel's gradient is NaN
    after = state()
    counters = {opt.iterations.path, opt.skipped_steps.path}

    def unchanged_but_the_counters(before, after):
        # The whole step is skipped (as under kmp.LossScaleOptimizer): no weight, no
        # compensation, no moment of any layer moves, whatever ReLU does with the NaN.
        for path in before:
            assert np.isfinite(after[path]).all(), path
            if path not in counters:
                assert np.array_equal(before[path], after[path]), path

    unchanged_but_the_counters(before, after)
    assert int(np_(opt.skipped_steps.value)) == 1
    # A skipped step is no update: `iterations` stays (as kmp.LossScaleOptimizer's does),
    # so the learning-rate schedule and Adam's bias correction see the updates applied.
    assert int(np_(opt.iterations.value)) == int(before[opt.iterations.path]) == 1
    # The same without ReLU in the way: one NaN in the first kernel's gradient alone.
    grads = [np.full(v.shape, 1e-3, "float32") for v in model.trainable_variables]
    grads[0][0, 0] = np.nan
    before = state()
    opt.apply(grads, model.trainable_variables)
    unchanged_but_the_counters(before, state())
    assert int(np_(opt.skipped_steps.value)) == 2
    grads[0][0, 0] = 1e-3  # and a finite step moves them again
    before = state()
    opt.apply(grads, model.trainable_variables)
    second = model.layers[2].kernel.path
    assert not np.array_equal(before[second], state()[second])
    assert int(np_(opt.skipped_steps.value)) == 2

    reg = kmp.convert(_mlp(), "lean_bfloat16")
    reg.compile(optimizer="adamw", loss="mse")
    target = np.zeros((8, 3), "float32")
    reg.train_on_batch(x[:8], target)
    kept = [v for v in reg.trainable_variables + reg.optimizer.variables
            if v.path not in (reg.optimizer.iterations.path, reg.optimizer.skipped_steps.path)]
    before = [np_(v.value) for v in kept]
    target[0, 0] = np.nan  # the loss itself is NaN: every gradient is
    reg.train_on_batch(x[:8], target)
    for a, v in zip(before, kept):
        np.testing.assert_array_equal(a, np_(v.value), err_msg=v.path)
    assert int(np_(reg.optimizer.skipped_steps.value)) == 1
    guard = kmp.callbacks.NonFiniteGuard(patience=2)
    reg.fit(x[:40], np.full((40, 3), np.nan, "float32"), batch_size=8, callbacks=[guard],
            verbose=0)
    assert reg.stop_training


def _bn_cnn(dtype=None):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(16, 3, padding="same", dtype=dtype)(inputs)
    h = keras.layers.BatchNormalization(dtype=dtype)(h)
    h = keras.layers.GlobalAveragePooling2D(dtype=dtype)(keras.layers.ReLU(dtype=dtype)(h))
    return keras.Model(inputs, keras.layers.Dense(3, dtype=dtype)(h))


def test_normalization_statistics_stay_float32():
    model = kmp.convert(_bn_cnn(), "lean_bfloat16")
    bn = model.layers[2]
    assert bn.gamma.dtype == "bfloat16"  # trainable: lean
    assert bn.moving_mean.dtype == "float32" and bn.moving_variance.dtype == "float32"
    x = np.random.default_rng(0).normal(3.0, 1.0, size=(64, 8, 8, 1)).astype("float32")
    y = np.zeros((64,), "int32")
    model.compile(optimizer="adam", loss=kmp.losses.SparseCategoricalCrossentropy(True))
    model.fit(x, y, batch_size=16, epochs=8, verbose=0)
    # 32 updates at momentum 0.99: the moving mean moved 1 - 0.99**32 = 27.5% of the way
    # to the batch means; in bfloat16 each 1% step is rounded (ulp 2**-8 near 1..2)
    mean = np_(bn.moving_mean.value)
    assert np.all(np.abs(mean) > 0)

    kmp.set_global_policy("lean_bfloat16")  # layers built under the policy: bf16 statistics
    built = _bn_cnn()
    assert built.layers[2].moving_mean.dtype == "bfloat16"
    built.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert built.layers[2].moving_mean.dtype == "float32"  # compile made them float32
    assert built.layers[2].gamma.dtype == "bfloat16"
    built.fit(x, y, batch_size=16, epochs=1, verbose=0)


def _embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 8)(inputs)  # TensorFlow: an IndexedSlices gradient
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs)


def test_sparse_embedding_gradient_follows_keras_adam():
    # Tokens repeat within each batch (10 ids, 48 lookups): on TensorFlow the embedding's
    # gradient is IndexedSlices and Keras' Adam averages the lookups' squared rows into
    # its second moment; the lean update must do the same (it squared the summed
    # gradient once, and trained compare's transformer to 0.52 val loss instead of 0.13).
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, size=(40, 6)).astype("int32")
    y = (x[:, 0] % 3).astype("int32")

    def train(opt):
        model = _embedding_model()
        model.compile(
            optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        for i in range(5):
            model.train_on_batch(x[i * 8 : i * 8 + 8], y[i * 8 : i * 8 + 8])
        return [np_(v.value) for v in model.trainable_variables]

    ref = train(keras.optimizers.Adam(1e-2))
    got = train(kmp.LeanOptimizer(keras.optimizers.Adam(1e-2), moments="float32"))
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
