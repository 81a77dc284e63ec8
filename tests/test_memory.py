"""kmp.state_bytes: what it counts, on plain models and on a GAN's container."""

import keras
import numpy as np
import pytest

import keras_mp as kmp


def _dense(units, name):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(units)], name=name)
    return kmp.convert(model, "lean_bfloat16")


class _GAN(keras.Model):  # keras-io's DCGAN: a container never called, two optimizers
    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator


def test_weights_only_says_so():
    model = _dense(4, "plain")
    state = kmp.state_bytes(model)
    assert state.optimizers == 0 and state.optimizer == state.compensation == 0
    assert state.per_parameter == 2.0  # bfloat16 weights alone
    assert "weights only: no optimizer" in str(state)


def test_container_with_two_optimizers_counts_each_once():
    d, g = _dense(1, "d"), _dense(8, "g")
    gan = _GAN(d, g)
    # kahan + int8 (the default before 2026-12-03): a compensation buffer to count too
    d_opt = kmp.LeanOptimizer(keras.optimizers.Adam(), rounding="kahan", moments="int8")
    g_opt = kmp.LeanOptimizer(keras.optimizers.Adam(), rounding="kahan", moments="int8")
    with pytest.raises(ValueError, match="is not built"):
        kmp.state_bytes(gan, [d_opt, g_opt])
    d_opt.build(d.trainable_variables)
    g_opt.build(g.trainable_variables)
    both = kmp.state_bytes(gan, [d_opt, g_opt])
    alone = [kmp.state_bytes(m, o) for m, o in ((d, d_opt), (g, g_opt))]
    assert both.optimizers == 2 and "(2 optimizers)" in str(both)
    assert both.parameters == sum(s.parameters for s in alone) == 9 + 72
    for field in ("weights", "compensation", "optimizer"):
        assert getattr(both, field) == sum(getattr(s, field) for s in alone)
    assert both.compensation == both.parameters  # one int8 byte per bfloat16 weight
    assert kmp.state_bytes(gan, [d_opt, g_opt, d_opt]) == both  # each state once
    with pytest.raises(ValueError, match="keras optimizer"):
        kmp.state_bytes(gan, ["adam"])


def test_an_unbuilt_model_is_refused_by_name():
    class Empty(keras.Model):
        pass

    with pytest.raises(ValueError, match="whose variables exist"):
        kmp.state_bytes(Empty())


def test_a_wrapper_and_its_inner_optimizer_count_once():
    model = kmp.convert(
        keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)]), "mixed_float16"
    )
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam())
    alone = kmp.state_bytes(model, opt)
    inner = opt.inner_optimizer
    counters = sum(  # the step counter (int64 on TensorFlow, int32 on JAX) and the rate
        np.dtype(v.dtype).itemsize for v in (inner.iterations, inner._learning_rate)
    )
    assert alone.optimizer == 2 * 36 * 4 + counters  # two float32 moments, iteration, lr
    assert kmp.state_bytes(model, [opt, opt.inner_optimizer]) == alone
