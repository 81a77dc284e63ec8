"""4-bit moments of the lean state (`moments="int4"`): the maps, packing, LeanOptimizer."""

import keras
import numpy as np
import pytest
from _lean_helpers import assert_resume_bit_identical, data, mlp, np_, train_batches
from keras import ops

import keras_mp as kmp
from keras_mp.lean import codecs, int4


def _moment(signed, shape=(3, 1000), seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=shape).astype("float32") * np.logspace(-4, 0, shape[-1], dtype="float32")
    return x if signed else x**2


# -- the maps ----------------------------------------------------------------------------


def test_second_moment_map_has_no_zero():
    levels = np_(int4.value(ops.arange(16, dtype="float32"), False))
    assert levels.min() > 0 and np.all(np.diff(levels) > 0)
    np.testing.assert_allclose(levels[[0, -1]], [(1 / 16) ** 4, 1.0], rtol=1e-6)
    # values far below the block's maximum (and exact zeros) decode to its smallest code
    v = np.array([[1.0, 1e-12, 0.0, 3e-6] + [0.5] * 124], "float32")
    codes, scales = codecs.encode_moment(v, "int4", False, None, 128)
    back = np_(codecs.decode_moment(codes, scales, "int4", False, v.shape, 128))
    assert back.min() > 0
    np.testing.assert_allclose(back[0, 1:3], (1 / 16) ** 4, rtol=1e-6)


def test_first_moment_codes_carry_the_sign_in_the_fourth_bit():
    whole = np_(int4.decode(ops.arange(16, dtype="float32"), True))
    magnitudes = (np.arange(8, dtype="float32") / 7) ** 3
    np.testing.assert_allclose(whole, np.concatenate([magnitudes, -magnitudes]), rtol=1e-6)
    np.testing.assert_array_equal(
        np_(int4.decode(ops.arange(16, dtype="float32"), False)),
        np_(int4.value(ops.arange(16, dtype="float32"), False)),
    )


@pytest.mark.parametrize("signed", [True, False])
def test_int4_moments_round_trip(signed):
    x = _moment(signed)
    layout = codecs.blocks_for(x.shape, 128)
    codes, scales = codecs.encode_moment(x, "int4", signed, codecs.uniforms(x.shape, 3, 1)[0], 128)
    assert keras.backend.standardize_dtype(codes.dtype) == "uint8"
    # 3000 values: 24 blocks of 125, two codes a byte (odd blocks padded)
    assert layout.length == 125 and tuple(codes.shape) == (24, 63) and tuple(scales.shape) == (24,)
    back = np_(codecs.decode_moment(codes, scales, "int4", signed, x.shape, layout))
    scale = np.repeat(np_(scales), 125).reshape(x.shape)
    err = np.abs(back - x) / scale
    # a value decodes to one of the two codes around it: the widest gap of the map is the
    # top one, 1 - (6/7)**3 = 0.370 (signed) and 1 - (15/16)**4 = 0.228 (unsigned)
    assert err.max() <= (0.371 if signed else 0.229), err.max()
    big = np.abs(x) > 0.3 * scale
    assert np.mean(err[big]) < (0.08 if signed else 0.04), np.mean(err[big])
    assert np.all(np.sign(back) * np.sign(x) >= 0)  # never the wrong sign
    if not signed:
        assert back.min() > 0


@pytest.mark.parametrize("signed", [True, False])
def test_int4_rounding_is_unbiased(signed):
    x = _moment(signed, shape=(1, 256))
    # 64 independent roundings of the same two blocks: one row of blocks each
    copies = np.repeat(x, 64, axis=0)
    noise = codecs.uniforms(copies.shape, 5, 1)[0]
    codes, scales = codecs.encode_moment(copies, "int4", signed, noise, 128)
    back = np_(codecs.decode_moment(codes, scales, "int4", signed, copies.shape, 128))
    scale = np.abs(x).reshape(2, 128).max(axis=1).repeat(128).reshape(x.shape)
    # the average of 64 roundings is within a small fraction of a code gap of every value
    assert np.abs(back.mean(axis=0) - x[0]).max() / scale.max() < 0.05
    # values on a code come back exactly
    exact = np_(int4.value(ops.arange(8 if signed else 16, dtype="float32"), signed))
    codes, scales = codecs.encode_moment(exact[None, :], "int4", signed, None, 128)
    back = np_(codecs.decode_moment(codes, scales, "int4", signed, (1, len(exact)), 128))
    np.testing.assert_allclose(back[0], exact, rtol=1e-5, atol=1e-7)


def test_int4_moments_follow_a_slow_average():
    # v <- 0.995 v + 0.005 g**2 with g**2 = 1 from v = 2: a change of 0.25% per step, far
    # below the 4-bit code step near the block's maximum (23%); the codes still follow it.
    v, exact = np.full((1, 2048), 2.0, "float32"), 2.0
    v[0, ::128] = 4.0  # each block's maximum stays put: the others move between codes
    keep = v == 4.0
    codes, scales = codecs.encode_moment(v, "int4", False, None, 128)
    for step in range(300):
        cur = codecs.decode_moment(codes, scales, "int4", False, v.shape, 128)
        noise = codecs.uniforms(v.shape, step + 1, 3)[step % 3]
        target = ops.where(keep, cur, cur * 0.995 + 0.005)
        codes, scales = codecs.encode_moment(target, "int4", False, noise, 128)
        exact = exact * 0.995 + 0.005
    got = np_(codecs.decode_moment(codes, scales, "int4", False, v.shape, 128))[~keep].mean()
    assert abs(got - exact) / exact < 0.03, (got, exact)


def test_int4_blocks_follow_the_shards():
    x = _moment(True, shape=(8, 512))
    layout = codecs.blocks_for(x.shape, 128, shards=(2, 4))
    codes, scales = codecs.encode_moment(x, "int4", True, None, layout)
    assert tuple(codes.shape) == (32, 64) and layout.per_shard == 4
    back = np_(codecs.decode_moment(codes, scales, "int4", True, x.shape, layout))
    # every block lies inside one shard: its scale is the maximum of that shard's rows
    shard = x[:4, :128]
    assert np.isclose(np_(scales)[0], np.abs(shard[0]).max())
    assert np.abs(back - x).max() <= 0.371 * np.abs(x).max()


# -- LeanOptimizer -----------------------------------------------------------------------


def _gpt2():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=256,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        intermediate_dim=256,
        max_sequence_length=64,
    )


def test_the_default_stochastic_int4_holds_3_bytes_a_parameter_on_gpt2():
    model = kmp.convert(_gpt2(), "lean_bfloat16")
    # the default until 2026-12-05 (now "int4_factored": tests/test_lean_factored.py)
    model.compile(optimizer=kmp.LeanOptimizer(keras.optimizers.AdamW(), moments="int4"), loss="mse")
    opt = model.optimizer
    assert (opt.rounding, opt.moments, opt.block_length) == ("stochastic", "int4", 128)
    opt.build(model.trainable_variables)
    state = kmp.state_bytes(model)
    n = state.parameters
    # bfloat16 weights (a few float32 ones the keep-list pins) and no compensation
    assert 2 * n <= state.weights <= 2.01 * n and state.compensation == 0
    assert 1.0 * n < state.optimizer <= 1.1 * n, str(state)  # m 0.5 + v 0.5 + scales
    assert state.per_parameter <= 3.1, str(state)  # 3.064 (120,576 parameters)
    kahan8 = kmp.LeanOptimizer(keras.optimizers.AdamW(1e-3), rounding="kahan", moments="int8")
    kahan8.build(model.trainable_variables)
    model.optimizer = kahan8
    assert kmp.state_bytes(model).per_parameter > 4.9


def _fit(policy, optimizer):
    x, y = data(512)
    model = kmp.convert(mlp(256), policy)
    model.compile(
        optimizer=optimizer,
        loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    model.fit(x, y, epochs=6, batch_size=32, shuffle=False, verbose=0)
    return model, float(model.evaluate(x, y, batch_size=512, verbose=0))


def test_int4_training_follows_mixed_bfloat16():
    _, mixed = _fit("mixed_bfloat16", keras.optimizers.AdamW(3e-3))
    model, lean = _fit(
        "lean_bfloat16",
        kmp.LeanOptimizer(keras.optimizers.AdamW(3e-3), rounding="stochastic", moments="int4"),
    )
    slots = [v for v in model.optimizer.variables if v.dtype == "uint8"]
    assert slots and all(tuple(v.shape)[-1] == 64 for v in slots if len(v.shape) == 2)
    # 96 steps from the same weights: the final loss within 10% of mixed_bfloat16's
    assert lean < 1.10 * mixed, (lean, mixed)


def test_int4_general_path():
    model, loss = _fit(
        "lean_bfloat16", kmp.LeanOptimizer(keras.optimizers.RMSprop(1e-3), moments="int4")
    )
    codes = [v for v in model.optimizer.variables if v.dtype == "uint8"]
    # RMSprop's velocities of the two kernels and the 256 bias: 16x256 in blocks of 128
    assert [tuple(v.shape) for v in codes] == [(32, 64), (2, 64), (6, 64)]
    assert loss < 0.5


def test_int4_config_save_load_and_resume_bit_identical(tmp_path):
    x, y = data(64)
    model = kmp.convert(mlp(256), "lean_bfloat16")
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(1e-3), rounding="stochastic", moments="int4")
    config = opt.get_config()
    assert config["moments"] == "int4" and config["block_size"] is None
    again = kmp.LeanOptimizer.from_config(config)
    assert (again.moments, again.rounding, again.block_length) == ("int4", "stochastic", 128)
    model.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    train_batches(model, x, y, 0, 3)
    loaded = assert_resume_bit_identical(model, str(tmp_path / "lean_int4.keras"), x, y)
    assert loaded.optimizer.moments == "int4"
