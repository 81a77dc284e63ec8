"""Keras' own LossScaleOptimizer in a loop written for float32 (issue 52, harness findings
H11-H13): it divides every gradient by its scale whether or not the loss was scaled, so a
loop that never calls `scale_loss` trains 32768 times too slowly with a finite loss. keras_mp
warns the first time such gradients are applied, and not when the loss was scaled."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp  # noqa: F401  (installs the check)

BACKEND = keras.backend.backend()


def _setup():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, dtype="mixed_bfloat16")])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    x = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
    return model, opt, x


def _steps(model, opt, x, scale: bool, n: int = 3):
    """n steps of the guides' loop (TensorFlow's GradientTape, JAX's stateless_apply)."""
    loss_of = lambda pred: keras.ops.mean(keras.ops.square(keras.ops.cast(pred, "float32") - 1))
    if BACKEND == "tensorflow":
        import tensorflow as tf

        for _ in range(n):
            with tf.GradientTape() as tape:
                loss = loss_of(model(x))
                if scale:
                    loss = opt.scale_loss(loss)
            opt.apply(tape.gradient(loss, model.trainable_weights), model.trainable_weights)
    else:
        import jax

        opt.build(model.trainable_variables)

        def f(tv, ntv):
            pred, _ = model.stateless_call(tv, ntv, x)
            loss = loss_of(pred)
            return opt.scale_loss(loss) if scale else loss

        tv = [v.value for v in model.trainable_variables]
        ntv = [v.value for v in model.non_trainable_variables]
        ov = [v.value for v in opt.variables]
        for _ in range(n):
            tv, ov = opt.stateless_apply(ov, jax.grad(f)(tv, ntv), tv)
        for v, value in zip(model.trainable_variables, tv):
            v.assign(value)


def _run(scale: bool):
    model, opt, x = _setup()
    before = model.get_weights()[0].copy()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _steps(model, opt, x, scale, n=1)
        moved = float(np.max(np.abs(model.get_weights()[0] - before)))
        _steps(model, opt, x, scale, n=2)
    words = [str(w.message) for w in seen if "never scaled" in str(w.message)]
    return words, moved


@pytest.mark.skipif(BACKEND not in ("tensorflow", "jax"), reason="the guides' two loops")
def test_unscaled_loop_is_warned_once_and_scaled_loop_is_not():
    words, moved_unscaled = _run(scale=False)
    assert len(words) == 1, words
    assert "32768" in words[0] and "scale_loss(loss)" in words[0]
    assert "kmp.LossScaleOptimizer" in words[0]
    words, moved_scaled = _run(scale=True)
    assert words == []
    # what the warning is about, measured on the first step: the unscaled loop's update is
    # 32768x smaller (within bfloat16's rounding of the scaled gradients)
    ratio = moved_scaled / moved_unscaled
    assert 2**15 * 0.98 < ratio < 2**15 * 1.02, ratio
