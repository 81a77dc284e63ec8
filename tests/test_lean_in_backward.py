"""The lean update inside the backward pass (`LeanOptimizer(update_in_backward=True)`, JAX).

Issue 54's lever 1 (`keras_mp.lean.in_backward`). The in-backward step must leave the
weights and the optimizer state of the ordinary lean step: both are compiled by `fit`
(one XLA program a step), run the same rule (`lean_rule`) on the same gradients with
the same learning rate, step count and noise seeds, so they are compared bit for bit
(the cases below are; a future XLA that fused the two programs' float32 arithmetic
differently could move a weight by one bfloat16 ulp, and this file would say so). A
non-finite batch must change no weight or moment bit and be counted; clipping must be
the clipped ordinary step's. Tiny models, a few steps each.
"""

import os

import keras
import numpy as np
import pytest

import keras_mp as kmp

JAX = keras.backend.backend() == "jax"
jax_only = pytest.mark.skipif(not JAX, reason="the update in the backward pass is JAX's")


def _bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" or a.dtype.itemsize == 2 else a


def _state(model) -> list:
    return [_bits(v.value) for v in model.trainable_variables + model.optimizer.variables]


def _dense(in_backward: bool, **optimizer_args):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    h = keras.layers.Dense(2048, activation="gelu")(inputs)  # 65,536 values: updated in
    h = keras.layers.Dense(64, activation="gelu")(h)  # the backward pass; biases packed
    model = kmp.convert(keras.Model(inputs, keras.layers.Dense(4)(h)), "lean_bfloat16")
    rate = optimizer_args.pop("learning_rate", 1e-3)
    inner = keras.optimizers.AdamW(rate, weight_decay=0.01, **optimizer_args)
    opt = kmp.LeanOptimizer(inner, update_in_backward=in_backward)
    model.compile(optimizer=opt, loss="mse")
    return model


def _data(n=32, nan_row=None):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n, 32)).astype("float32")
    y = rng.normal(size=(n, 4)).astype("float32")
    if nan_row is not None:
        x[nan_row, 3] = np.nan
    return x, y


def _fit_both(make, x, y, batch_size=8, epochs=2):
    out = []
    for in_backward in (False, True):
        model = make(in_backward)
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        out.append((model, history.history["loss"]))
    return out


def _assert_same(ordinary, in_backward, exact=True):
    """Bit for bit; or (`exact=False`: global-norm clipping, whose float32 norm the first
    pass sums in another fused reduction than Keras' `clip_by_global_norm`, so the scale
    may differ by an ulp) float32 values within 1e-5 relative, bfloat16 weights within one
    ulp, and at most 1% of the quantized moments' codes off."""
    (m0, loss0), (m1, loss1) = ordinary, in_backward
    np.testing.assert_allclose(loss0, loss1, rtol=0 if exact else 1e-6)
    variables = m0.trainable_variables + m0.optimizer.variables
    for v, a, b in zip(variables, _state(m0), _state(m1)):
        if exact:
            np.testing.assert_array_equal(a, b, err_msg=v.path)
        elif v.dtype == "float32":
            np.testing.assert_allclose(a.view("f4"), b.view("f4"), rtol=1e-5, err_msg=v.path)
        elif v.dtype == "bfloat16":
            assert np.abs(a.astype("i4") - b.astype("i4")).max() <= 1, v.path
        else:
            assert (a != b).mean() <= 0.01, v.path
    assert int(m0.optimizer.iterations.value) == int(m1.optimizer.iterations.value)


@jax_only
@pytest.mark.parametrize(
    "args",
    [
        # the default run keeps global_clipnorm (its norm comes from the first pass); the
        # schedule and clipnorm cases run with -m slow (CI time: ~12 s each on the CPU)
        pytest.param(
            {"learning_rate": keras.optimizers.schedules.ExponentialDecay(1e-3, 2, 0.5)},
            marks=pytest.mark.slow,
        ),
        {"global_clipnorm": 0.05},
        pytest.param({"clipnorm": 0.05}, marks=pytest.mark.slow),
    ],
    ids=["schedule", "global_clipnorm", "clipnorm"],
)
def test_dense_matches_the_ordinary_lean_step(args):
    x, y = _data(n=24)
    ordinary, in_backward = _fit_both(lambda ib: _dense(ib, **dict(args)), x, y, epochs=1)
    assert in_backward[0].train_step.func.__module__ == "keras_mp.lean.in_backward"
    assert not hasattr(ordinary[0].train_step, "func")
    _assert_same(ordinary, in_backward, exact="global_clipnorm" not in args)
    assert int(in_backward[0].optimizer.iterations.value) == 3


@jax_only
def test_clipping_acts():
    """The clipped cases above are not vacuous: the first moment of the clipped step is
    the clipped gradient's (AdamW's weights barely see a scaled gradient)."""
    x, y = _data()
    plain = _dense(True)
    clipped = _dense(True, global_clipnorm=0.05)
    for model in (plain, clipped):
        model.train_on_batch(x[:8], y[:8])
    i = next(
        i for i, v in enumerate(plain.optimizer.variables) if v.path.endswith("momentum_scale")
    )
    a = np.asarray(plain.optimizer.variables[i].value)
    b = np.asarray(clipped.optimizer.variables[i].value)
    assert a.size == 512 and b.max() < 0.5 * a.max()


@jax_only
@pytest.mark.slow  # CI time; the chunked update's own tests (test_lean_chunked) stay
def test_row_blocks_and_raw_gradients_match(monkeypatch):
    """A large matrix's update in row blocks, its gradient handed on as it came
    (`keras_mp.lean.chunked`, forced small here)."""
    from keras_mp.lean import chunked

    monkeypatch.setenv(chunked.CHUNK_ENV, "8192")
    x, y = _data(n=16)
    # XLA:CPU fuses the two programs' row-block loops alike but not identically (an FMA
    # here, a rounding there): the 4-bit moments' float32 scales may differ by an ulp
    _assert_same(*_fit_both(lambda ib: _dense(ib), x, y, epochs=1), exact=False)


@jax_only
def test_a_nan_sample_skips_the_whole_step_and_is_counted():
    x, y = _data(n=8, nan_row=5)
    model = _dense(True)
    model.optimizer.build(model.trainable_variables)
    before = _state(model)
    logs = model.train_on_batch(x, y, return_dict=True)
    assert not np.isfinite(logs["loss"])
    variables = model.trainable_variables + model.optimizer.variables
    for v, a, b in zip(variables, before, _state(model)):
        if v is model.optimizer.skipped_steps:
            continue
        np.testing.assert_array_equal(a, b, err_msg=v.path)
    assert int(model.optimizer.skipped_steps.value) == 1
    assert int(model.optimizer.iterations.value) == 0
    # and the next finite batch is the ordinary step's first
    x, y = _data(n=8)
    model.train_on_batch(x, y)
    ordinary = _dense(False)
    ordinary.train_on_batch(x, y)
    for a, b in zip(_state(ordinary)[:6], _state(model)[:6]):  # the weights
        np.testing.assert_array_equal(a, b)


def _llama(in_backward: bool):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=512,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=128,
        intermediate_dim=512,
    )
    task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    task = kmp.convert(task, "lean_bfloat16")
    opt = kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-3, weight_decay=0.01, global_clipnorm=1.0),
        update_in_backward=in_backward,
    )
    task.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    return task


@jax_only
@pytest.mark.slow  # two Llama train steps compiled: about 30 s of the CPU alone
@pytest.mark.filterwarnings("ignore:Layer\\(s\\) .*attention_softmax")
def test_tiny_llama_matches_the_ordinary_lean_step():
    """keras_hub's Llama-3 (untied head, 65,536-value matrices updated in the backward
    pass), global-norm clipping, two steps."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (4, 17)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((4, 16), "int32")}
    y = tokens[:, 1:]
    _assert_same(*_fit_both(_llama, x, y, batch_size=2, epochs=1), exact=False)


@jax_only
def test_refusals_name_why():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 cannot be combined"):
        kmp.LeanOptimizer(
            keras.optimizers.AdamW(gradient_accumulation_steps=2), update_in_backward=True
        )
    with pytest.raises(ValueError, match="general path"):
        kmp.LeanOptimizer(keras.optimizers.RMSprop(), update_in_backward=True)
    with pytest.raises(ValueError, match="update_in_backward"):
        kmp.LeanOptimizer(keras.optimizers.AdamW(), update_in_backward="yes")

    class OwnStep(keras.Model):
        def train_step(self, *args, **kwargs):
            return super().train_step(*args, **kwargs)

    inputs = keras.Input((4,))
    model = OwnStep(inputs, keras.layers.Dense(2)(inputs))
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(), update_in_backward=True)
    with pytest.raises(ValueError, match="has its own train_step"):
        model.compile(optimizer=opt, loss="mse")


@jax_only
def test_applied_the_ordinary_way_it_says_so_and_config_keeps_it():
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(), update_in_backward=True)
    assert kmp.LeanOptimizer.from_config(opt.get_config()).update_in_backward
    variable = keras.Variable(np.ones((4, 4)), dtype="float32")
    with pytest.raises(RuntimeError, match="inside the backward pass"):
        opt.apply([keras.ops.ones((4, 4))], [variable])


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the TensorFlow backend's refusal"
)
def test_tensorflow_refuses_naming_jax():
    assert os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow"
    with pytest.raises(ValueError, match="JAX backend only"):
        kmp.LeanOptimizer(keras.optimizers.AdamW(), update_in_backward=True)
