"""keras.io's own training code, converted: it trains as in float32, or says what it misses.

The examples are in `keras_io_examples` (the "Customizing fit()" guide's `train_step` and
GAN, the VAE, the English-to-Spanish Transformer, the timeseries Transformer, the JAX
guide's stateless loop). Each is trained in float32, then converted to `mixed_float16`
and `lean_bfloat16` and trained the same way from the same weights and data; its last
epoch's loss must lie within 5% of float32's. A plain optimizer the example applies itself
to lean weights (the GAN's two Adams, the JAX loop's) warns naming `kmp.LeanOptimizer`, and
trains within 5% once wrapped in it.
"""

import warnings

import keras
import keras_io_examples as examples
import numpy as np
import pytest

import keras_mp as kmp

BACKEND = keras.backend.backend()
POLICIES = ["mixed_float16", "lean_bfloat16"]
_FLOAT32: dict = {}


def _float32(name):
    if name not in _FLOAT32:
        _FLOAT32[name] = examples.run(name, "float32")[1]
    return _FLOAT32[name]


def _run(name, policy, optimizers=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, history = examples.run(name, policy, optimizers)
    return model, history, [str(w.message) for w in caught]


def _close(history, reference, keys):
    for key in keys:
        got, want = history[key][-1], reference[key][-1]
        assert np.isfinite(got) and abs(got - want) <= 0.05 * abs(want), (key, got, want)


def _skip_float16_attention_on_jax(policy):
    if policy == "mixed_float16" and BACKEND == "jax":
        pytest.skip("JAX's CPU has no float16 dot_general with float32 accumulation "
                    "(the attention einsums); float16 Dense and Conv1D run")


def _skip_tf_only(name):
    if name in examples.TF_ONLY and BACKEND != "tensorflow":
        pytest.skip(f"the {name} example's train_step uses tf.GradientTape")


@pytest.mark.parametrize("policy", POLICIES)
def test_guide_train_step_with_sgd_trains_as_in_float32(policy):
    """The guide's `train_step` never scales the loss; with SGD its float16 gradients used
    to be divided by the scale anyway (loss stuck at its first value)."""
    _skip_tf_only("train_step")
    reference = _float32("train_step")
    model, history, messages = _run("train_step", policy)
    assert reference["loss"][-1] < 0.8 * reference["loss"][0]  # float32 learns
    _close(history, reference, ["loss", "mae"])
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, kmp.LossScaleOptimizer)
        assert float(model.optimizer.loss_scale) == 2.0**15  # never reached the loss: kept
        assert sum("never scaled" in m for m in messages) == 1
    else:
        assert isinstance(model.optimizer, kmp.LeanOptimizer)


@pytest.mark.parametrize("policy", POLICIES)
def test_gan_with_its_own_optimizers(policy):
    """`super().compile()` with no arguments leaves Keras' default alone (lean used to raise
    about an RMSprop the user never wrote); the GAN's own Adams warn once each about what
    they miss, and trained wrapped (lean) or as they are (float16) match float32."""
    _skip_tf_only("gan")
    reference = _float32("gan")
    gan, history, messages = _run("gan", policy)
    assert not isinstance(gan.optimizer, (kmp.LeanOptimizer, keras.optimizers.LossScaleOptimizer))
    if policy == "lean_bfloat16":
        warned = [m for m in messages if "kmp.LeanOptimizer" in m]
        assert len(warned) == 2 and all("pure bfloat16" in m for m in warned), messages
        wrapped = (kmp.LeanOptimizer(keras.optimizers.Adam(learning_rate=0.0003)),
                   kmp.LeanOptimizer(keras.optimizers.Adam(learning_rate=0.0003)))
        gan, history, messages = _run("gan", policy, wrapped)
        assert not any("kmp.LeanOptimizer(" in m for m in messages), messages
    else:
        warned = [m for m in messages if "kmp.LossScaleOptimizer" in m]
        assert len(warned) == 2 and all("without loss scaling" in m for m in warned), messages
    _close(history, reference, ["d_loss", "g_loss"])


@pytest.mark.parametrize("policy", POLICIES)
def test_vae_own_losses_add_up_in_float32(policy):
    """The VAE's `train_step` adds its reconstruction loss (from the decoder's float32
    sigmoid) to its KL loss (from the encoder's `z_mean`, `z_log_var`): the converted
    encoder hands them over in float32."""
    _skip_tf_only("vae")
    reference = _float32("vae")
    vae, history, _ = _run("vae", policy)
    z_mean, z_log_var, z = vae.encoder(np.zeros((2, 28, 28, 1), "float32"))
    assert {keras.backend.standardize_dtype(t.dtype) for t in (z_mean, z_log_var, z)} == {
        "float32"}
    assert vae.encoder.get_layer("z_mean").compute_dtype != "float32"  # the math stays low
    _close(history, reference, ["loss", "reconstruction_loss"])


@pytest.mark.parametrize("policy,optimizer", [
    ("mixed_float16", "rmsprop"), ("lean_bfloat16", "rmsprop"),
    # unknown static shapes are TensorFlow's: on JAX the general path (rmsprop) is enough
    pytest.param("lean_bfloat16", "adam", marks=pytest.mark.tf_only)])
def test_translation_transformer_with_sequences_of_unknown_length(policy, optimizer):
    """Gradients of unknown static shape (batches of unknown length through the position
    embedding and the masks) reach the scaler and the lean update (they used to fail in
    `LossScaleOptimizer.apply`: `as_list() is not defined on an unknown TensorShape`), and
    the lean update of RMSprop (the general path) trains like float32."""
    _skip_float16_attention_on_jax(policy)
    if optimizer == "rmsprop":
        reference = _float32("translation")
    else:
        reference = examples.run("translation", "float32", optimizer)[1]
    model, history, _ = _run("translation", policy, optimizer)
    if policy == "lean_bfloat16":  # RMSprop through the general path (issue 33.4)
        assert model.optimizer.general == (optimizer == "rmsprop")
    assert reference["loss"][-1] < reference["loss"][0]
    _close(history, reference, ["loss"])


@pytest.mark.parametrize("policy", POLICIES)
def test_timeseries_transformer(policy):
    _skip_float16_attention_on_jax(policy)
    reference = _float32("timeseries")
    _, history, _ = _run("timeseries", policy)
    _close(history, reference, ["loss"])


@pytest.mark.skipif(BACKEND != "jax", reason="the JAX guide's stateless loop")
@pytest.mark.parametrize("policy", POLICIES)
def test_jax_stateless_loop(policy):
    """The guide's loop applies its own Adam with `stateless_apply`: on lean weights it
    warns naming kmp.LeanOptimizer, and wrapped in it trains as float32 does."""
    reference = examples.jax_loop("float32")
    assert reference[-1] < 0.8 * reference[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = examples.jax_loop(policy)
    messages = [str(w.message) for w in caught]
    if policy == "lean_bfloat16":
        assert sum("kmp.LeanOptimizer" in m for m in messages) == 1, messages
        losses = examples.jax_loop(policy, kmp.LeanOptimizer(keras.optimizers.Adam(1e-3)))
    else:
        assert sum("kmp.LossScaleOptimizer" in m for m in messages) == 1, messages
        losses = plain
    assert abs(np.mean(losses[-4:]) - np.mean(reference[-4:])) <= 0.05 * np.mean(reference[-4:])
