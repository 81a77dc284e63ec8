"""The 4-bit lean update as one Pallas kernel (`keras_mp.lean.kernel`): run by Pallas'
interpreter on this CPU it gives `lean_rule`'s bits, in the rule and through `fit`.
Compiled by Triton for a GPU it is timed by `benchmarks/lean_formats.py --kernel`."""

import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: JAX only")

if BACKEND == "jax":
    import jax
    import keras
    from keras import ops

    import keras_mp as kmp
    from keras_mp.lean import codecs
    from keras_mp.lean import kernel as lean_kernel
    from keras_mp.lean.rule import Hyper, Static, lean_rule


def _inputs(shape, rounding, weight_dtype="bfloat16", decay=True, seed=0):
    rng = np.random.default_rng(seed)
    blocks = codecs.blocks_for(shape, 128)
    m = rng.normal(size=shape).astype("float32") * 1e-3
    v = np.square(rng.normal(size=shape).astype("float32") * 1e-3)
    m_codes, m_scale = codecs.encode_moment(m, "int4", True, None, blocks)
    v_codes, v_scale = codecs.encode_moment(v, "int4", False, None, blocks)
    values = {
        "weight": ops.cast(rng.normal(size=shape).astype("float32"), weight_dtype),
        "grad": ops.cast(rng.normal(size=shape).astype("float32") * 1e-2, "bfloat16"),
        "lr": ops.convert_to_tensor(1e-3, "float32"),
        "iterations": ops.convert_to_tensor(41, "int32"),
        "seed": ops.convert_to_tensor(7919 * 3, "int32"),
        "m": m_codes,
        "m_scale": m_scale,
        "v": v_codes,
        "v_scale": v_scale,
    }
    if decay:
        values["weight_decay"] = ops.convert_to_tensor(0.1, "float32")
    if rounding == "kahan" and weight_dtype == "bfloat16":
        values["compensation"] = ops.cast(rng.integers(-127, 128, size=shape), "int8")
    if rounding == "kahan16" and weight_dtype == "bfloat16":
        values["compensation"] = ops.cast(rng.normal(size=shape) * 1e-3, "bfloat16")
    return Static(shape, weight_dtype, "int4", "int4", blocks), values


def _bits(x):
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _both(static, hyper, values, **kwargs):
    ref = jax.jit(lambda v: lean_rule(static, hyper, v))(values)
    got = jax.jit(
        lambda v: lean_kernel.lean_kernel_rule(static, hyper, v, interpret=True, **kwargs)
    )(values)
    return ref, got


@pytest.mark.parametrize(
    "shape, rounding, weight_dtype, kind, decay",
    [
        ((64, 256), "stochastic", "bfloat16", "adamw", True),  # 128 blocks, 16 programs
        ((64, 256), "kahan", "bfloat16", "adamw", True),
        ((3, 384), "kahan16", "bfloat16", "adam", False),  # 9 blocks: one a program
        ((32, 128), "stochastic", "float32", "adamw", True),  # float32 weights: exact
    ],
)
def test_kernel_gives_lean_rules_bits(shape, rounding, weight_dtype, kind, decay):
    static, values = _inputs(shape, rounding, weight_dtype, decay)
    hyper = Hyper(kind, rounding, 0.9, 0.999, 1e-7, 0.0, False)
    assert lean_kernel.applies(static, hyper, values)
    ref, got = _both(static, hyper, values)
    assert sorted(ref) == sorted(got)
    for name in ref:
        assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype, name
        np.testing.assert_array_equal(_bits(got[name]), _bits(ref[name]), err_msg=name)
    # and the update did something: the weight and both moments' codes moved
    for name in ("weight", "m", "v"):
        assert (_bits(got[name]) != _bits(values[name])).mean() > 0.05, name


def test_programs_of_other_sizes_give_the_same_bits():
    static, values = _inputs((64, 256), "stochastic")
    hyper = Hyper("adamw", "stochastic", 0.9, 0.999, 1e-7, 0.0, False)
    ref, _ = _both(static, hyper, values)
    for rows in (1, 4, 32):
        _, got = _both(static, hyper, values, rows=rows)
        for name in ref:
            np.testing.assert_array_equal(_bits(got[name]), _bits(ref[name]), err_msg=name)
    with pytest.raises(ValueError, match="rows=3 does not divide 128 blocks"):
        _both(static, hyper, values, rows=3)


def test_a_nan_gradient_keeps_every_value():
    static, values = _inputs((16, 256), "kahan")
    grad = np.array(ops.cast(values["grad"], "float32"))
    grad[7, 100] = np.nan
    values["grad"] = ops.cast(grad, "bfloat16")
    hyper = Hyper("adamw", "kahan", 0.9, 0.999, 1e-7, 0.0, False)
    _, got = _both(static, hyper, values)
    for name in ("weight", "compensation", "m", "m_scale", "v", "v_scale"):
        np.testing.assert_array_equal(_bits(got[name]), _bits(values[name]), err_msg=name)


def test_what_the_kernel_does_not_take():
    hyper = Hyper("adamw", "stochastic", 0.9, 0.999, 1e-7, 0.0, False)
    static, values = _inputs((64, 256), "stochastic")
    assert not lean_kernel.applies(static._replace(m="int8", v="int8"), hyper, values)
    assert not lean_kernel.applies(static, hyper._replace(kind="sgd"), values)
    assert not lean_kernel.applies(static, hyper, {**values, "grad_square": values["grad"]})
    sharded = codecs.blocks_for((64, 256), 128, shards=(2, 1))
    assert not lean_kernel.applies(static._replace(blocks=sharded), hyper, values)
    odd = (10, 120)  # 10 blocks of 120: not a power of two
    assert not lean_kernel.applies(
        static._replace(shape=odd, blocks=codecs.blocks_for(odd, 128)), hyper, values
    )
    padded = (5, 70)  # 350 values: 3 blocks of 117, the last one padded
    assert not lean_kernel.applies(
        static._replace(shape=padded, blocks=codecs.blocks_for(padded, 128)), hyper, values
    )


def _fit(monkeypatch, kernel: str):
    monkeypatch.setenv("KERAS_MP_LEAN_KERNEL", kernel)
    keras.utils.set_random_seed(1)
    base = keras.Sequential(
        [keras.Input((256,)), keras.layers.Dense(512, activation="gelu"), keras.layers.Dense(256)]
    )
    model = kmp.convert(base, "lean_bfloat16")
    # int4 for both moments (the kernel's format; the default factors these kernels' second)
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(), moments="int4")
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 256)).astype("float32")
    x[20, 3] = np.nan  # the second batch's gradient is NaN: a skipped step
    losses = [float(model.train_on_batch(x[i : i + 16], 0.5 * x[i : i + 16])) for i in (0, 16, 0)]
    return losses, [np.asarray(v.value) for v in model.weights + model.optimizer.variables]


def test_fit_with_the_kernel_gives_the_same_bits(monkeypatch):
    traced = []
    rule = lean_kernel.lean_kernel_rule

    def counted(*args, **kwargs):
        traced.append(args[0].shape)
        return rule(*args, **kwargs)

    monkeypatch.setattr(lean_kernel, "lean_kernel_rule", counted)
    losses_xla, xla = _fit(monkeypatch, "xla")
    assert traced == []
    losses, pallas = _fit(monkeypatch, "pallas")
    assert sorted(traced) == [(256, 512), (512, 256)]  # the two kernels; biases are packed
    assert np.isnan(losses[1]) and losses[2] < losses[0]
    assert losses == pytest.approx(losses_xla, nan_ok=True)
    for a, b in zip(xla, pallas):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_an_unknown_kernel_is_named(monkeypatch):
    monkeypatch.setenv("KERAS_MP_LEAN_KERNEL", "triton")
    with pytest.raises(ValueError, match="KERAS_MP_LEAN_KERNEL='triton'.*'xla', 'pallas'"):
        kmp.LeanOptimizer(keras.optimizers.AdamW())
