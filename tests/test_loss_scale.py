"""LossScaleOptimizer and the pure loss-scale rule, on TensorFlow and JAX."""

import dataclasses
import math

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from keras import ops

import keras_mp as kmp
from keras_mp.scaling.loss_scale import (
    LossScaleConfig,
    LossScaleState,
    initial_loss_scale_state,
    update_loss_scale,
)

BACKEND = keras.backend.backend()


# --------------------------------------------------------------------------- reference


def reference_rule(cfg, flags_per_step):
    """Plain-Python statement of the rule: one dict of state per step (after it)."""
    scale, good, hyst, skipped, last = float(cfg.initial_scale), 0, cfg.hysteresis, 0, -1
    n = len(flags_per_step[0]) if flags_per_step else 0
    mask = [0] * n
    out = []
    for step, flags in enumerate(flags_per_step):
        if all(flags):
            good += 1
            if cfg.dynamic and good >= cfg.growth_interval:
                grown = float(np.float32(scale) * np.float32(cfg.growth_factor))
                scale = min(grown, cfg.max_scale)
                good, hyst = 0, cfg.hysteresis
        else:
            # Before the first finite step the k-th backoff is backoff_factor ** k.
            k = min(max(skipped - (cfg.hysteresis - 1), 0) + 1, 32) if skipped == step else 1
            factor = np.float32(cfg.backoff_factor**k)  # rounded once
            good, skipped, last = 0, skipped + 1, step
            hyst = max(hyst - 1, 0)
            mask = [0 if f else 1 for f in flags]
            if cfg.dynamic and hyst <= 0:
                shrunk = float(np.float32(scale) * np.float32(factor))
                scale = max(shrunk, cfg.min_scale)
        out.append(dict(scale=float(np.float32(scale)), good=good, hyst=hyst, skipped=skipped,
                        last=last, mask=list(mask)))
    return out


configs = st.builds(
    lambda gi, gf, bf, lo, span, hy, dyn, pos: LossScaleConfig(
        initial_scale=float(2.0 ** (lo + pos * span)),
        growth_interval=gi,
        growth_factor=gf,
        backoff_factor=bf,
        min_scale=float(2.0**lo),
        max_scale=float(2.0 ** (lo + span)),
        hysteresis=hy,
        dynamic=dyn,
    ),
    gi=st.integers(1, 6),
    gf=st.sampled_from([1.5, 2.0, 4.0, 10.0]),
    bf=st.sampled_from([0.5, 0.25, 0.9, 0.125]),
    lo=st.integers(-4, 4),
    span=st.integers(0, 12),
    hy=st.integers(1, 3),
    dyn=st.booleans(),
    pos=st.sampled_from([0.0, 0.5, 1.0]),
)


def _state_dict(state, i=None):
    def pick(x):
        a = keras.ops.convert_to_numpy(x)
        return a if i is None else a[i]

    return dict(
        scale=float(pick(state.scale)),
        good=int(pick(state.good_steps)),
        hyst=int(pick(state.hysteresis_left)),
        skipped=int(pick(state.skipped_steps)),
        last=int(pick(state.last_overflow_step)),
        mask=[int(m) for m in pick(state.nonfinite_mask)],
    )


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(cfg=configs, seed=st.integers(0, 2**31 - 1), p_bad=st.sampled_from([0.0, 0.05, 0.3, 0.9]))
def test_rule_matches_reference_on_thousands_of_sequences(cfg, seed, p_bad):
    """30 configs x 64 independent sequences x 40 steps (1,920 sequences), every step."""
    batch, steps, n_vars = 64, 40, 3
    rng = np.random.default_rng(seed)
    flags = rng.random((steps, batch, n_vars)) >= p_bad / n_vars
    init = initial_loss_scale_state(cfg, n_vars)
    state = LossScaleState(*[np.broadcast_to(f, (batch,) + np.shape(f)).copy() for f in init])
    refs = [reference_rule(cfg, [list(flags[t, b]) for t in range(steps)]) for b in range(batch)]
    for t in range(steps):
        state = update_loss_scale(state, flags[t], np.full((batch,), t, "int32"), cfg)
        scales = keras.ops.convert_to_numpy(state.scale)
        assert np.all(np.isfinite(scales)) and np.all(scales > 0)
        assert np.all(scales >= np.float32(cfg.min_scale))
        assert np.all(scales <= np.float32(cfg.max_scale))
        for b in (0, batch // 2, batch - 1):
            assert _state_dict(state, b) == refs[b][t], (cfg, t, b)
        got = np.stack([keras.ops.convert_to_numpy(state.scale)])[0]
        np.testing.assert_array_equal(got, [refs[b][t]["scale"] for b in range(batch)])


# --------------------------------------------------------------------------- optimizer


def _stateful_or_stateless(opt, variables, grads):
    """One optimizer step the way each backend's trainer takes it: `grads` are those of a
    loss scaled by `opt.scale_loss` (the trainers call it; here it only marks the step)."""
    opt.scale_loss(1.0)
    if BACKEND == "jax":  # jitted, as the JAX trainer runs it
        import jax

        if not hasattr(opt, "_test_jitted_apply"):
            opt._test_jitted_apply = jax.jit(opt.stateless_apply)
        tv, ov = opt._test_jitted_apply(
            [v.value for v in opt.variables], grads, [v.value for v in variables]
        )
        for ref, val in zip(opt.variables, ov):
            ref.assign(val)
        for ref, val in zip(variables, tv):
            ref.assign(val)
    else:
        opt.apply(grads, variables)


def _opt_state(opt):
    return dict(
        scale=float(opt.loss_scale),
        good=int(opt.step_counter),
        hyst=int(opt.hysteresis_left),
        skipped=int(opt.skipped_steps),
        last=int(opt.last_overflow_step),
        mask=[int(m) for m in ops.convert_to_numpy(opt.nonfinite_mask.value)],
    )


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(cfg=configs, seed=st.integers(0, 2**31 - 1))
def test_optimizer_follows_reference(cfg, seed):
    rng = np.random.default_rng(seed)
    steps = 12
    # Same-shaped variables apart in the list: on JAX they are checked as one stack.
    shapes = [(3,), (2,), (3,), (2, 2), (2,)]
    flags = rng.random((steps, len(shapes))) >= 0.15
    variables = [keras.Variable(np.ones(shape, "float32")) for shape in shapes]
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **dataclasses.asdict(cfg))
    opt.build(variables)
    ref = reference_rule(cfg, [list(f) for f in flags])
    applied = 0
    for t in range(steps):
        before = [v.numpy() if hasattr(v, "numpy") else ops.convert_to_numpy(v) for v in variables]
        grads = [
            ops.ones(shape) * (1.0 if ok else (np.nan, np.inf)[i % 2])
            for i, (shape, ok) in enumerate(zip(shapes, flags[t]))
        ]
        _stateful_or_stateless(opt, variables, grads)
        assert _opt_state(opt) == ref[t], t
        after = [ops.convert_to_numpy(v) for v in variables]
        if flags[t].all():
            applied += 1
        else:
            for a, b in zip(before, after):
                np.testing.assert_array_equal(a, b)
        assert int(opt.iterations) == applied


def test_same_scale_sequence_on_every_backend():
    """A literal sequence: the TF run and the JAX run of this suite both check it."""
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=16.0, growth_interval=2, hysteresis=2,
        min_scale=2.0, max_scale=64.0,
    )
    v = [keras.Variable(np.zeros((2,), "float32"))]
    opt.build(v)
    pattern = "GGGGGBBGBBBBBBGGGGGGGG"  # G: finite step, B: inf step
    scales = []
    for c in pattern:
        g = ops.ones((2,)) if c == "G" else ops.array([1.0, np.inf])
        _stateful_or_stateless(opt, v, [g])
        scales.append(float(opt.loss_scale))
    assert scales == [
        16, 32, 32, 64, 64, 64, 32, 32, 16, 8, 4, 2, 2, 2, 2, 4, 4, 8, 8, 16, 16, 32,
    ]
    assert int(opt.skipped_steps) == 8
    assert int(opt.last_overflow_step) == 13
    assert int(opt.iterations) == len(pattern) - 8


def test_scale_never_reaches_zero_or_inf():
    """Stock Keras 3.15 falls to 0.0 after ~200 overflows and grows to inf; ours is bounded."""
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=1)
    v = [keras.Variable(np.zeros((2,), "float32"))]
    opt.build(v)
    step = keras.ops.ones((2,))
    for _ in range(30):
        _stateful_or_stateless(opt, v, [step])
    assert float(opt.loss_scale) == 2.0**24
    for _ in range(60):
        _stateful_or_stateless(opt, v, [ops.array([np.nan, 0.0])])
    assert float(opt.loss_scale) == 1.0
    assert int(opt.skipped_steps) == 60


def test_loss_scale_before_the_first_step_is_the_initial_scale():
    # It was an AttributeError: the scale variable is made when the optimizer is built.
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=512.0)
    assert not opt.built and float(opt.loss_scale) == 512.0
    opt.build([keras.Variable(np.zeros((2,), "float32"))])
    assert float(opt.loss_scale) == 512.0 and opt.loss_scale is opt.dynamic_scale


def test_static_scale_never_changes_but_still_skips():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=128.0, dynamic=False,
                                 growth_interval=1)
    v = [keras.Variable(np.zeros((2,), "float32"))]
    opt.build(v)
    _stateful_or_stateless(opt, v, [ops.array([128.0, 256.0])])
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [-1.0, -2.0])
    _stateful_or_stateless(opt, v, [ops.array([np.inf, 256.0])])
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [-1.0, -2.0])
    assert float(opt.loss_scale) == 128.0 and int(opt.skipped_steps) == 1


def test_skipped_step_leaves_weights_and_adam_slots_bit_identical():
    v = [keras.Variable(np.linspace(-1, 1, 6).astype("float32").reshape(2, 3))]
    opt = kmp.LossScaleOptimizer(keras.optimizers.AdamW(1e-2), initial_scale=4.0)
    opt.build(v)
    for k in range(3):
        _stateful_or_stateless(opt, v, [ops.ones((2, 3)) * (k + 1)])
    snapshot = [ops.convert_to_numpy(x).copy() for x in opt.inner_optimizer.variables + v]
    bad = np.ones((2, 3), "float32")
    bad[1, 2] = np.nan
    _stateful_or_stateless(opt, v, [ops.convert_to_tensor(bad)])
    after = [ops.convert_to_numpy(x) for x in opt.inner_optimizer.variables + v]
    assert len(snapshot) == len(after) > 3
    for a, b in zip(snapshot, after):
        np.testing.assert_array_equal(a, b)
    assert int(opt.iterations) == 3
    assert opt.nonfinite_variable_names() == [v[0].path]


def test_inner_clipnorm_clips_true_gradients():
    """Unscale first, then the inner optimizer's global_clipnorm sees true gradients."""
    scale = 2.0**12
    true_g = np.array([3.0, 4.0], "float32")  # norm 5 -> clipped to 1
    v = [keras.Variable(np.zeros((2,), "float32"))]
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(1.0, global_clipnorm=1.0),
                                 initial_scale=scale)
    opt.build(v)
    _stateful_or_stateless(opt, v, [ops.convert_to_tensor(true_g * scale)])
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [-0.6, -0.8], rtol=1e-6)


# ------------------------------------------------------ stock Keras test expectations
# Ported from keras/src/optimizers/loss_scale_optimizer_test.py. Our defaults differ by
# design (max_scale 2**24, min_scale 1; the initial scale is 2**15 as in Keras); these
# cases pass explicit values or do not depend on them.


def test_keras_finite_step_and_apply_without_vars():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    v = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.build(v)
    grads = [ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale]
    if BACKEND == "jax":
        _stateful_or_stateless(opt, v, grads)
    else:
        opt.scale_loss(1.0)
        opt.apply(grads)  # trainable_variables taken from build()
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [0.5, -1.0, -0.5, 3.0], atol=1e-4)


def test_keras_inner_loss_scale_factor_does_not_interfere():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5, loss_scale_factor=100))
    v = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.build(v)
    _stateful_or_stateless(opt, v, [ops.array([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale])
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [0.5, -1.0, -0.5, 3.0], atol=1e-4)


def test_keras_overwrite_with_gradient_is_not_unscaled():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=0.5))
    v = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    v[0].overwrite_with_gradient = True
    opt.build(v)
    _stateful_or_stateless(opt, v, [ops.array([1.0, 6.0, 7.0, 2.0])])
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [1.0, 6.0, 7.0, 2.0])


def test_keras_downscaling_and_upscaling():
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=400.0)
    v = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.build(v)
    # Overflows before any finite step back off 1, 2, 3, 4 halvings: 400 -> 200 -> 50 ->
    # 6.25 -> 0.39, floored at min_scale (Keras' rule: 25).
    scales = []
    for _ in range(4):
        _stateful_or_stateless(opt, v, [ops.array([np.inf] * 4)])
        scales.append(float(ops.convert_to_numpy(opt.dynamic_scale)))
    assert scales == [200.0, 50.0, 6.25, 1.0]
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [1.0, 2.0, 3.0, 4.0])
    # Once a step held, each backoff halves once, as in Keras: 400 / 2**4 = 25.
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=400.0)
    v = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.build(v)
    _stateful_or_stateless(opt, v, [ops.array([0.0] * 4)])
    for _ in range(4):
        _stateful_or_stateless(opt, v, [ops.array([np.inf] * 4)])
    np.testing.assert_allclose(ops.convert_to_numpy(opt.scale_loss(1.0)), 25.0)

    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=2.0,
                                 dynamic_growth_steps=2)
    v = [keras.Variable([1.0, 2.0, 3.0, 4.0])]
    opt.build(v)
    for _ in range(8):
        _stateful_or_stateless(opt, v, [ops.array([1.0, 6.0, 7.0, 2.0])])
    np.testing.assert_allclose(ops.convert_to_numpy(opt.scale_loss(1.0)), 32.0)
    assert int(opt.iterations) == 8


def test_config_round_trip_and_serialization():
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, momentum=0.06, nesterov=True, weight_decay=0.004),
        initial_scale=8.0, growth_interval=7, growth_factor=3.0, backoff_factor=0.25,
        min_scale=2.0, max_scale=1024.0, hysteresis=3, dynamic=False,
    )
    config = opt.get_config()
    clone = kmp.LossScaleOptimizer.from_config(config)
    assert clone.get_config() == config
    assert clone.loss_scale_config == opt.loss_scale_config
    revived = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(opt))
    assert type(revived) is kmp.LossScaleOptimizer
    assert revived.get_config() == config
    # A stock Keras config (dynamic_growth_steps) loads into ours.
    stock = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), dynamic_growth_steps=5)
    assert kmp.LossScaleOptimizer.from_config(stock.get_config()).growth_interval == 5


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(min_scale=4.0, max_scale=2.0, initial_scale=3.0), "min_scale"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=2.5), "growth_interval"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(initial_scale=math.inf), "initial_scale"),
        (dict(initial_scale=2.0**30), "initial_scale"),
        (dict(max_scale=math.inf), "max_scale"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        kmp.LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_refuses_to_wrap_a_loss_scale_optimizer_or_a_non_optimizer():
    inner = kmp.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        kmp.LossScaleOptimizer(inner)
    with pytest.raises(ValueError, match="already a LossScaleOptimizer"):
        kmp.LossScaleOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="inner_optimizer"):
        kmp.LossScaleOptimizer("adam")


# --------------------------------------------------------------------------- in fit


def _blobs(n=512, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(4, 8)) * 3
    y = rng.integers(0, 4, n)
    x = (centers[y] + rng.normal(size=(n, 8))).astype("float32")
    return x, y.astype("int32")


def _mlp():
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    )


@pytest.mark.parametrize("jit", [False, True] if BACKEND == "tensorflow" else [True])
def test_nan_batch_in_fit_is_skipped_and_training_reaches_same_accuracy(jit):
    x, y = _blobs()
    x_bad = x.copy()
    x_bad[64:96] = np.nan  # exactly the third batch of 32
    results = {}
    for name, data in (("clean", x), ("nan", x_bad)):
        keras.utils.set_random_seed(1)
        model = _mlp()
        opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=2.0**10)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=jit)
        model.fit(data, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
        w = [ops.convert_to_numpy(v) for v in model.trainable_variables]
        assert all(np.isfinite(a).all() for a in w)
        acc = model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"]
        results[name] = (acc, int(opt.skipped_steps), float(opt.loss_scale), int(opt.iterations))
    assert results["clean"][1] == 0 and results["nan"][1] == 3  # one per epoch
    assert results["nan"][2] == 2.0**10 / 8
    assert results["nan"][3] == results["clean"][3] - 3
    assert results["clean"][0] > 0.95
    assert abs(results["nan"][0] - results["clean"][0]) < 0.02


@pytest.mark.tf_only
def test_mixed_float16_compile_uses_ours_without_double_wrapping():
    keras.config.set_dtype_policy("mixed_float16")
    model = _mlp()
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**40 / 2**16)
    model.compile(opt, "mse", jit_compile=True)
    assert model.optimizer is opt
    x, y = _blobs(64)
    model.fit(x, keras.utils.to_categorical(y, 4), batch_size=32, epochs=1, verbose=0)
    assert int(opt.iterations) + int(opt.skipped_steps) == 2
    assert float(opt.loss_scale) <= 2.0**24  # capped even with a huge initial scale request


def test_apply_in_a_custom_loop_on_every_backend():
    """`apply` works eagerly on JAX too (it routes through `stateless_apply`)."""
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=4.0)
    v = [keras.Variable(np.ones((2,), "float32"))]
    opt.scale_loss(1.0)
    opt.apply([ops.ones((2,)) * 4.0], v)  # builds on first use
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [0.5, 0.5])
    opt.scale_loss(1.0)
    opt.apply([ops.array([np.nan, 1.0])], v)
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [0.5, 0.5])
    assert float(opt.loss_scale) == 2.0 and int(opt.iterations) == 1
    assert int(opt.skipped_steps) == 1 and int(opt.last_overflow_step) == 1


def test_gradients_of_an_unscaled_loss_are_not_divided():
    """A step whose loss never went through `scale_loss` (a custom train_step written for
    float32) applies its gradients as they are, keeps the scale, still skips non-finite
    steps, and warns once saying how to scale; one that did is divided. Compiled, the trace
    decides: on TensorFlow inside `tf.function`, on JAX inside `jax.jit`."""
    opt = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=4.0)
    v = [keras.Variable(np.ones((2,), "float32"))]
    opt.build(v)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        step = tf.function(lambda g: opt.apply([g], v))
    else:
        step = lambda g: opt.apply([g], v)  # noqa: E731  (JAX: routes through stateless_apply)
    with pytest.warns(UserWarning, match=r"never scaled.*scale_loss\(loss\)") as caught:
        step(ops.ones((2,)))
        step(ops.array([np.nan, 1.0]))
        step(ops.ones((2,)))
    assert len([w for w in caught if "never scaled" in str(w.message)]) == 1
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [0.0, 0.0])  # 1 - 2 * 0.5
    assert float(opt.loss_scale) == 4.0 and int(opt.skipped_steps) == 1
    opt.scale_loss(1.0)
    opt.apply([ops.ones((2,)) * 4.0], v)  # eager, marked: divided by the scale
    np.testing.assert_allclose(ops.convert_to_numpy(v[0]), [-0.5, -0.5])


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX train step as XLA compiles it")
def test_jax_step_skips_with_a_select_not_a_conditional():
    """On JAX a skipped step keeps the weights and slots by a select that XLA fuses into the
    update. A conditional whose skip branch passes them through stays a conditional in
    XLA (an empty branch is "faster than a select"), and on XLA:GPU its outputs were
    copied into the step's: every weight and slot each step (BENCHMARKS.md section 9)."""
    import re

    import jax

    weights = [keras.Variable(np.ones(shape, "float32")) for shape in ((16, 32), (32,), (4,))]
    opt = kmp.LossScaleOptimizer(keras.optimizers.AdamW(1e-3))
    opt.build(weights)
    step = jax.jit(opt.stateless_apply, donate_argnums=(0, 2))
    values = [w.value for w in weights]
    lowered = step.lower([v.value for v in opt.variables], values, values)
    text = lowered.compile().as_text()
    assert not re.search(r" conditional\(", text)


_EVERY_OPTIMIZER = [
    "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Ftrl", "Lamb", "Lion",
    "Nadam", "RMSprop", "SGD",
]  # fmt: skip


def _train_dense(optimizer, steps=5):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    )
    model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False)
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    for _ in range(steps):
        model.train_on_batch(x, y)
    return model, [ops.convert_to_numpy(v) for v in model.trainable_variables]


@pytest.mark.parametrize("name", _EVERY_OPTIMIZER)
def test_wrapped_at_scale_one_trains_like_the_plain_optimizer(name):
    """The skip-only wrapper (what compile gives under mixed_bfloat16) changes no step of any
    Keras optimizer, and keeps every variable the plain one has. Nadam keeps `_u_product` as an
    attribute: Keras' own wrapper builds it untracked, and on JAX its update was dropped
    (5 steps: 4.5e-3 apart). TensorFlow: bit-identical; JAX: within float32 rounding (XLA
    fuses the skip's select into the update)."""
    plain = getattr(keras.optimizers, name)(2e-3)
    inner = getattr(keras.optimizers, name)(2e-3)
    wrapped = kmp.LossScaleOptimizer(inner, initial_scale=1.0, dynamic=False)
    _, want = _train_dense(plain)
    _, got = _train_dense(wrapped)
    assert len(inner.variables) == len(plain.variables)
    for a, b in zip(want, got):
        if BACKEND == "tensorflow":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_wrapped_nadam_saves_and_resumes_its_attribute_variable(tmp_path):
    """Save after 3 steps, load, 2 more: the 5 steps of an uninterrupted run (its `_u_product`
    saved, not reset to 1); a file without it (Keras' own wrapper wrote it) loads the rest
    with a warning naming what starts afresh."""
    wrap = lambda: kmp.LossScaleOptimizer(keras.optimizers.Nadam(2e-3), 1.0, dynamic=False)  # noqa: E731
    _, want = _train_dense(wrap(), steps=5)
    model, _ = _train_dense(wrap(), steps=3)
    u_product = float(ops.convert_to_numpy(model.optimizer.inner_optimizer._u_product))
    assert 0 < u_product < 0.8  # moved from 1.0
    model.save(tmp_path / "nadam.keras")
    loaded = keras.saving.load_model(tmp_path / "nadam.keras")
    assert float(ops.convert_to_numpy(loaded.optimizer.inner_optimizer._u_product)) == u_product
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    for _ in range(2):
        loaded.train_on_batch(x, y)
    for a, b in zip(want, loaded.trainable_variables):
        np.testing.assert_allclose(a, ops.convert_to_numpy(b), rtol=0, atol=1e-6)

    opt = loaded.optimizer
    old = {str(i): ops.convert_to_numpy(v) for i, v in enumerate(model.optimizer.variables[:-1])}
    with pytest.warns(UserWarning, match=r"no value for \[.*\].*initial values"):
        opt.load_own_variables(old)
    assert int(opt.iterations) == 3  # the rest did load
