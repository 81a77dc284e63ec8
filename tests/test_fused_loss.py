"""The fused linear + cross-entropy (issue 54, lever 3) and its route through `fit`.

`keras_mp.numerics.linear_cross_entropy` against the plain loss on the logits (values and
both gradients, float32 within 1e-5 relative; bfloat16 against a float32 reference),
tied and untied kernels, soft cap, masked positions; on JAX its compiled temporaries
against the plain loss's. `use_fused_loss` on tiny keras_hub `GPT2CausalLM` (tied
embedding) and `Llama3CausalLM` (untied head): one `fit` step gives the plain step's loss,
accuracy and weights, with `ignore_class` and padding weights; `predict` still returns
logits; what it cannot do is refused by name.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_mp.numerics.fused_lm_loss import use_fused_loss
from keras_mp.numerics.linear_cross_entropy import chunk_for, linear_cross_entropy

BACKEND = keras.backend.backend()


def _value_and_grads(f, h, w):
    if BACKEND == "jax":
        import jax

        value, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)
        return value, grads
    import tensorflow as tf

    @tf.function
    def run(h, w):
        with tf.GradientTape() as tape:
            tape.watch([h, w])
            value = f(h, w)
        return value, tape.gradient(value, [h, w])

    return run(tf.constant(h), tf.constant(w))


def _plain(labels, valid, weights, transposed, cap):
    def loss(h, w):
        z = ops.matmul(
            ops.cast(h, "float32"), ops.cast(ops.transpose(w) if transposed else w, "float32")
        )
        if cap:
            z = cap * ops.tanh(z / cap)
        picked = ops.take_along_axis(z, ops.expand_dims(labels, -1), axis=-1)
        per = ops.logsumexp(z, axis=-1) - ops.squeeze(picked, -1)
        return ops.sum(ops.where(valid, per, 0.0) * weights)

    return loss


def _fused(labels, valid, weights, transposed, cap):
    def loss(h, w):
        per, _ = linear_cross_entropy(
            h, w, labels, transposed=transposed, valid=valid, logit_soft_cap=cap, chunk=128
        )
        return ops.sum(per * weights)

    return loss


def _case(dtype, transposed, vocabulary=300):
    rng = np.random.default_rng(0)
    h = rng.normal(size=(2, 6, 16)).astype("float32")
    w = rng.normal(size=(vocabulary, 16) if transposed else (16, vocabulary)).astype("float32")
    if dtype == "bfloat16":
        h, w = (ops.cast(x, "bfloat16") for x in (h, w))
    labels = rng.integers(0, vocabulary, size=(2, 6)).astype("int32")
    valid = rng.random((2, 6)) > 0.25
    weights = rng.random((2, 6)).astype("float32")
    return h, w, labels, valid, weights


def _rel(a, b):
    a = np.asarray(ops.convert_to_numpy(ops.cast(a, "float32")))
    b = np.asarray(ops.convert_to_numpy(ops.cast(b, "float32")))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(a)))


@pytest.mark.parametrize("transposed,cap", [(False, None), (True, None), (False, 5.0)])
def test_values_and_gradients_match_the_plain_loss(transposed, cap):
    """300 words in chunks of 128 (two whole, a tail of 44); a quarter of the positions
    masked; per-position weights."""
    h, w, labels, valid, weights = _case("float32", transposed)
    args = (labels, valid, weights, transposed, cap)
    plain, grads = _value_and_grads(_plain(*args), h, w)
    fused, fused_grads = _value_and_grads(_fused(*args), h, w)
    assert _rel(plain, fused) < 1e-5
    for a, b in zip(grads, fused_grads):
        assert _rel(a, b) < 1e-5


def test_bfloat16_within_its_rounding():
    """bfloat16 hidden states and kernel: the loss (float32) within 1e-5 of the float32
    loss on the same values, each gradient (returned in bfloat16) within 1e-2 relative
    (bfloat16's ulp is 2**-8 = 0.4%)."""
    h, w, labels, valid, weights = _case("bfloat16", False)
    args = (labels, valid, weights, False, None)
    plain, grads = _value_and_grads(_plain(*args), ops.cast(h, "float32"), ops.cast(w, "float32"))
    fused, fused_grads = _value_and_grads(_fused(*args), h, w)
    assert _rel(plain, fused) < 1e-5
    for a, b in zip(grads, fused_grads):
        assert b.dtype == "bfloat16" or str(b.dtype) == "<dtype: 'bfloat16'>"
        assert _rel(a, b) < 1e-2


def test_predicted_is_the_argmax():
    h, w, labels, valid, _ = _case("float32", False)
    _, predicted = linear_cross_entropy(h, w, labels, chunk=128)
    logits = np.asarray(ops.convert_to_numpy(ops.matmul(h, w)))
    np.testing.assert_array_equal(np.asarray(ops.convert_to_numpy(predicted)), logits.argmax(-1))


@pytest.mark.skipif(BACKEND != "jax", reason="XLA's compiled memory statistics (JAX)")
def test_compiled_temporaries_stay_below_the_logits():
    """2048 tokens x 16,384 words: the plain loss and gradient hold float32 logits (128
    MiB); the fused one, in chunks of 1024 words, less than a quarter of that."""
    import jax
    import jax.numpy as jnp

    tokens, width, vocabulary = 2048, 32, 16384
    h = jax.ShapeDtypeStruct((tokens, width), jnp.float32)
    w = jax.ShapeDtypeStruct((width, vocabulary), jnp.float32)
    labels = jnp.zeros((tokens,), jnp.int32)
    valid = jnp.ones((tokens,), bool)
    weights = jnp.ones((tokens,), jnp.float32)

    def temp(f):
        step = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        return step.lower(h, w).compile().memory_analysis().temp_size_in_bytes

    def fused(h, w):
        per, _ = linear_cross_entropy(h, w, labels, valid=valid, chunk=1024)
        return ops.sum(per)

    logits = tokens * vocabulary * 4
    assert temp(_plain(labels, valid, weights, False, None)) >= logits
    assert temp(fused) < logits / 4
    assert chunk_for(2048, 128256) == 8192  # 64 MiB of float32 logits a chunk


def _task(kind, seed=1):
    import keras_hub

    keras.utils.set_random_seed(seed)
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=300,
            num_layers=1,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=16,
            dropout=0.0,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=300,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
    )
    return keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)


def _batch():
    rng = np.random.default_rng(0)
    mask = np.ones((2, 8), bool)
    mask[1, 6:] = False
    x = {"token_ids": rng.integers(0, 300, (2, 8)), "padding_mask": mask}
    y = rng.integers(0, 300, (2, 8))
    y[0, 2] = 3  # ignore_class
    return x, y, mask.astype("float32")


@pytest.mark.parametrize("kind", ["gpt2", "llama3"])
def test_fit_step_matches_the_plain_step(kind):
    x, y, weights = _batch()
    results = []
    for fused in (False, True):
        task = _task(kind)
        if fused:
            assert use_fused_loss(task) is task
        task.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=3),
            weighted_metrics=["sparse_categorical_accuracy"],
        )
        logs = task.train_on_batch(x, y, sample_weight=weights, return_dict=True)
        after = logs
        if kind == "llama3":  # evaluate and predict once (each compiles a step)
            after = task.evaluate(x, y, sample_weight=weights, return_dict=True, verbose=0)
            logits = task.predict(x, verbose=0)
            assert logits.shape == (2, 8, 300)  # predict: the logits, fused or not
        weights_now = [np.asarray(ops.convert_to_numpy(v)) for v in task.trainable_variables]
        results.append((logs, after, weights_now))
    (logs, after, plain), (f_logs, f_after, fused_w) = results
    for a, b in ((logs, f_logs), (after, f_after)):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert a["sparse_categorical_accuracy"] == b["sparse_categorical_accuracy"]
    for a, b in zip(plain, fused_w):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert any(np.any(a != b) for a, b in zip(plain, [w * 0 for w in plain]))


def test_refusals_name_the_fix():
    x, y, weights = _batch()
    task = use_fused_loss(_task("llama3"))
    task.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False),
        weighted_metrics=[],
    )
    with pytest.raises(ValueError, match="SparseCategoricalCrossentropy"):
        task.train_on_batch(x, y)
    task = use_fused_loss(_task("llama3"))
    task.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["sparse_top_k_categorical_accuracy"],
    )
    with pytest.raises(ValueError, match="sparse_top_k_categorical_accuracy"):
        task.train_on_batch(x, y)
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
    with pytest.raises(ValueError, match="bias or an activation"):
        use_fused_loss(plain)


def test_convert_lean_with_fused_loss():
    """`kmp.convert(task, "lean_bfloat16", fused_loss=True)`: the bfloat16 model's first
    fused step's loss is the plain loss of its logits within bfloat16's rounding."""
    import keras_mp as kmp

    x, y, weights = _batch()
    task = kmp.convert(_task("llama3"), "lean_bfloat16", check=None, fused_loss=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = float(loss(y, task(x), sample_weight=weights))  # a call: the whole logits
    task.compile(optimizer="adamw", loss=loss, weighted_metrics=[])
    fused = task.train_on_batch(x, y, sample_weight=weights, return_dict=True)["loss"]
    assert np.isfinite(fused) and abs(plain - fused) < 2e-2 * plain
