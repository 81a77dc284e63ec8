"""kmp.recompute_blocks: each decoder block recomputed from its inputs (JAX and TensorFlow)."""

import functools

import keras
import numpy as np
import pytest
from test_recompute import _saved_bytes  # the residuals jax.vjp keeps, weights left out

import keras_mp as kmp
from keras_mp.memory.blocks import find_blocks

BACKEND = keras.backend.backend()
JAX = BACKEND == "jax"
needs_jax = pytest.mark.skipif(not JAX, reason="jax.checkpoint's policies: the JAX backend only")
keras_hub = pytest.importorskip("keras_hub")


def _llama(dropout=0.0, policy=None, recompute=None, seed=0):
    """A tiny keras_hub Llama-3 (2 blocks, vocabulary 64), the same weights for a seed."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        dropout=dropout,
    )
    model = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    if policy is not None:
        model = kmp.convert(model, policy, check=None)
    if recompute is not None:
        assert kmp.recompute_blocks(model, save=recompute) is model
    return model


def _batch():
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 64, (2, 8)).astype("int32"),
        "padding_mask": np.array([[1] * 8, [1] * 5 + [0] * 3], "int32"),
    }
    return x, rng.integers(0, 64, (2, 8)).astype("int32")


def _loss(logits, y):
    losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return keras.ops.mean(keras.ops.cast(losses, "float32"))


def _loss_and_grads(model, x, y):
    """The training-mode loss and its gradients with respect to the trainable weights."""
    if JAX:
        import jax

        others = [v.value for v in model.non_trainable_variables]

        def loss(trainable):
            logits, _ = model.stateless_call(trainable, others, x, training=True)
            return _loss(logits, y)

        step = jax.jit(jax.value_and_grad(loss))
        value, grads = step([v.value for v in model.trainable_variables])
    else:
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = _loss(model(x, training=True), y)
        grads = tape.gradient(value, model.trainable_variables)
    return float(value), [keras.ops.convert_to_numpy(g).astype("float32") for g in grads]


def _train(model, x, y, steps=3):
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[],
    )
    return [float(model.train_on_batch(x, y)) for _ in range(steps)]


def test_the_decoder_blocks_are_found_and_named_ones_taken():
    model = _llama()
    names = [f"transformer_layer_{i}" for i in range(2)]
    assert [b.name for b in find_blocks(model)] == names
    assert find_blocks(model.backbone) == find_blocks(model)
    # a regular expression, names, layers: the same two blocks
    for blocks in ("transformer_layer_.*", names, "layers"):
        again = _llama()
        kmp.recompute_blocks(again, find_blocks(again) if blocks == "layers" else blocks)
        assert (
            sorted(layer.name for layer in again._flatten_layers() if "call" in layer.__dict__)
            == names
        )


def test_dropout_blocks_give_the_plain_loss_and_gradients():
    """With dropout 0.25 in every block: the recomputation must draw the forward pass's
    masks (the seed state goes in as an argument; on TensorFlow the backward pass runs the
    block again outside its `__call__`, with `training` and the autocast scope restored).
    Loss and gradients equal the plain model's (float32: atol 1e-6)."""
    x, y = _batch()
    plain, ours = _llama(0.25), _llama(0.25, recompute="inputs")
    loss_plain, grads_plain = _loss_and_grads(plain, x, y)
    loss_ours, grads_ours = _loss_and_grads(ours, x, y)
    assert loss_ours == pytest.approx(loss_plain, rel=1e-6)
    for a, b in zip(grads_plain, grads_ours):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.slow
def test_dropout_blocks_train_as_the_plain_model():
    """`fit`'s compiled step: the seeds move as the plain model's (the recomputed
    function hands their new state out), so 2 SGD steps give its losses and weights."""
    x, y = _batch()
    plain, ours = _llama(0.25), _llama(0.25, recompute="inputs")
    np.testing.assert_allclose(_train(plain, x, y, 2), _train(ours, x, y, 2), rtol=1e-6)
    for a, b in zip(plain.weights, ours.weights):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), atol=1e-6
        )


def test_the_blocks_run_again_in_the_backward_pass():
    """What makes it save memory: each block's forward pass runs again for its gradient.
    JAX: `jax.vjp` keeps under 0.35x the plain model's bytes for the backward pass (only
    the blocks' inputs; "matmuls" keeps more, still less than plain). TensorFlow (eager):
    each block's `call` runs twice a step (forward, then recomputed), once without."""
    x, y = _batch()
    if JAX:
        saved = {r: _saved_bytes(_llama(recompute=r), x) for r in (None, "inputs", "matmuls")}
        assert saved["inputs"] < 0.35 * saved[None]
        assert saved["inputs"] < saved["matmuls"] < saved[None]
        return
    plain, ours = _llama(), _llama()
    decoder = type(find_blocks(plain)[0])
    counted = []
    call = decoder.call

    @functools.wraps(call)
    def counting(self, *args, **kwargs):
        counted.append(self.name)
        return call(self, *args, **kwargs)

    decoder.call = counting  # after the models are built, before recompute_blocks
    try:
        kmp.recompute_blocks(ours)
        for model, runs in ((plain, 1), (ours, 2)):
            counted.clear()
            _loss_and_grads(model, x, y)
            assert sorted(counted) == sorted(["transformer_layer_0", "transformer_layer_1"] * runs)
    finally:
        decoder.call = call


@pytest.mark.slow
def test_a_converted_lean_model_trains_as_without_it():
    """After `kmp.convert(..., "lean_bfloat16")` (bfloat16 weights and compute, stochastic
    rounding): loss and gradients those of the converted model without recomputation
    within bfloat16's rounding (compiled, XLA fuses the recomputed bfloat16 work its own
    way: gradients up to 0.25 differ by at most 2**-10, asserted 2**-9; op by op they are
    bit-identical). Two compiled SGD steps (lr 0.5): the
    first loss equal, then within bfloat16's noise (XLA fuses the compiled step's bfloat16
    work differently around the checkpoints: measured 2e-5 relative in the second loss,
    2**-10 in the weights, on JAX)."""
    x, y = _batch()
    plain = _llama(policy="lean_bfloat16")
    ours = _llama(policy="lean_bfloat16", recompute="inputs")
    loss_plain, grads_plain = _loss_and_grads(plain, x, y)
    loss_ours, grads_ours = _loss_and_grads(ours, x, y)
    assert loss_ours == pytest.approx(loss_plain, rel=1e-4)
    for a, b in zip(grads_plain, grads_ours):
        np.testing.assert_allclose(a, b, atol=2**-9)
    first, second = _train(plain, x, y, 2), _train(ours, x, y, 2)
    assert first[0] == pytest.approx(second[0], rel=1e-6)
    assert second[1] == pytest.approx(first[1], rel=1e-4)
    for a, b in zip(plain.weights, ours.weights):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(a).astype("float32"),
            keras.ops.convert_to_numpy(b).astype("float32"),
            atol=4e-3,
        )


@pytest.mark.slow
@needs_jax
def test_matmuls_trains_as_plain():
    x, y = _batch()
    plain, ours = _llama(0.25), _llama(0.25, recompute="matmuls")
    np.testing.assert_allclose(_train(plain, x, y, 2), _train(ours, x, y, 2), rtol=1e-6)


def test_bad_arguments_are_refused_by_name():
    model = _llama()
    with pytest.raises(ValueError, match=r"save='everything'; one of \('inputs', 'matmuls'\)"):
        kmp.recompute_blocks(model, save="everything")
    with pytest.raises(ValueError, match="has no layer named 'block_9'"):
        kmp.recompute_blocks(model, ["block_9"])
    with pytest.raises(ValueError, match="no layer of .* has a name matching 'decoder_.*'"):
        kmp.recompute_blocks(model, "decoder_.*")
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="no repeated block found"):
        kmp.recompute_blocks(dense)
    with pytest.raises(ValueError, match="is a model; name the layers inside it"):
        kmp.recompute_blocks(model, [model.backbone.name])
    if not JAX:
        with pytest.raises(ValueError, match="save='matmuls' needs a checkpoint policy"):
            kmp.recompute_blocks(model, save="matmuls")
    else:
        cut = kmp.recompute_elementwise(_llama())
        with pytest.raises(ValueError, match="already cut by recompute_elementwise"):
            kmp.recompute_blocks(cut)
    assert not any("call" in layer.__dict__ for layer in model._flatten_layers())
