"""kmp.recompute_elementwise: matmul and attention outputs saved, the rest recomputed (JAX)."""

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.cli.workloads import WORKLOADS
from keras_mp.memory.recompute import regions

JAX = keras.backend.backend() == "jax"
needs_jax = pytest.mark.skipif(not JAX, reason="jax.checkpoint: the JAX backend only")


def _weights(model):
    return [keras.ops.convert_to_numpy(v) for v in model.weights]


def _saved_bytes(model, x):
    """Bytes of what the forward pass keeps for the backward pass (the residuals of
    `jax.vjp` with respect to the trainable weights, the weights themselves left out)."""
    import jax

    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def forward(trainable):
        out, _ = model.stateless_call(trainable, others, x, training=True)
        return keras.ops.mean(keras.ops.cast(out, "float32"))

    _, vjp = jax.vjp(forward, trainable)
    given = {id(a) for a in trainable + others}
    leaves = jax.tree_util.tree_leaves(vjp)
    return sum(a.nbytes for a in leaves if hasattr(a, "nbytes") and id(a) not in given)


@needs_jax
def test_gpt_saves_less_than_half_and_trains_the_same():
    """The harness' tiny GPT (1 block, 2 x 64 tokens): cut at each residual add, it keeps
    0.38x the bytes for the backward pass (measured 459,264 vs 1,223,959: the layer norms'
    and the GELU's outputs are recomputed), and 3 SGD steps give the plain model's losses
    and weights (the same operations, run again)."""
    gpt = WORKLOADS["tiny_gpt"]
    x, y = gpt.data(np.random.default_rng(0))

    def build(recompute):
        keras.utils.set_random_seed(0)
        model = gpt.build(keras)
        if recompute:
            assert kmp.recompute_elementwise(model) is model
        return model

    plain, ours = build(False), build(True)
    kinds = [
        sorted(type(x).__name__ for x in r.model.layers if type(x).__name__ != "InputLayer")
        for r in regions(build(False))
    ]
    assert kinds == [
        ["Embedding"],
        ["Add", "LayerNormalization", "MultiHeadAttention"],
        ["Add", "Dense", "Dense", "LayerNormalization"],
        ["LayerNormalization"],
        ["Dense"],
    ]
    assert _saved_bytes(ours, x) <= 0.45 * _saved_bytes(plain, x)
    losses = []
    for model in (plain, ours):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        losses.append([float(model.train_on_batch(x, y)) for _ in range(3)])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    assert losses[1][-1] < losses[1][0]
    for a, b in zip(_weights(plain), _weights(ours)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _stateful_model():
    """Dropout (a seed that moves), batch norm (statistics that move), an activity
    regulariser (an added loss) and a Keras mask, each crossing a cut."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(20, 16, mask_zero=True)(ids)
    for _ in range(2):
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(32, activation="gelu", activity_regularizer="l2")(h)
        h = keras.layers.Dropout(0.3)(h)
        x = keras.layers.Add()([x, keras.layers.Dense(16)(h)])
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.GlobalAveragePooling1D()(x)  # averages the unmasked steps only
    return keras.Model(ids, keras.layers.Dense(3)(x))


@needs_jax
def test_dropout_batch_norm_added_losses_and_masks_match_the_plain_model():
    ids = np.random.default_rng(0).integers(1, 20, (32, 6)).astype("int32")
    ids[:, 4:] = 0  # padding: masked
    y = np.random.default_rng(1).normal(size=(32, 3)).astype("float32")
    runs = []
    for recompute in (False, True):
        model = _stateful_model()
        if recompute:
            kmp.recompute_elementwise(model)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        history = model.fit(ids, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
        runs.append((history.history["loss"], _weights(model), model(ids[:4], training=False)))
    (loss_a, w_a, out_a), (loss_b, w_b, out_b) = runs
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)  # same dropout masks, same penalty
    for a, b in zip(w_a, w_b):  # batch norm's moving statistics among them
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(out_a, out_b, atol=1e-5)


@needs_jax
def test_keras_hub_causal_lm_is_cut_inside_its_backbone():
    """A task model is one node (the backbone) and a head: the backbone is cut inside."""
    keras_hub = pytest.importorskip("keras_hub")

    def build():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=16,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 64, (4, 16)).astype("int32"),
        "padding_mask": np.ones((4, 16), "int32"),
    }
    y = rng.integers(0, 64, (4, 16)).astype("int32")
    plain, ours = build(), build()
    kmp.recompute_elementwise(ours)
    assert len(regions(ours.backbone)) >= 3  # embeddings, each decoder block, ...
    losses = []
    for model in (plain, ours):
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
        losses.append([np.ravel(model.train_on_batch(x, y))[0] for _ in range(2)])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


@needs_jax
def test_sequential_and_a_subclassed_model():
    """A Sequential (an added loss included: it goes to the Sequential, not its inner
    graph) trains as the plain one; a subclassed model and an unbuilt Sequential are
    refused by name."""
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")
    losses = []
    for recompute in (False, True):
        keras.utils.set_random_seed(0)
        seq = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activity_regularizer="l2"),
                keras.layers.LayerNormalization(),
                keras.layers.Dense(8, activation="gelu"),
                keras.layers.Dense(2),
            ]
        )
        if recompute:
            kmp.recompute_elementwise(seq)
            assert len(regions(seq._functional)) >= 2
        seq.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses.append(seq.fit(x, y, epochs=2, verbose=0).history["loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)

    class Net(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match=r"needs a functional model.*subclassed Net"):
        kmp.recompute_elementwise(Net(name="net"))
    with pytest.raises(ValueError, match="is not built"):
        kmp.recompute_elementwise(keras.Sequential([keras.layers.Dense(2)]))


@pytest.mark.skipif(JAX, reason="the refusal on other backends")
def test_other_backends_are_refused_by_name():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"JAX backend only.*'tensorflow'"):
        kmp.recompute_elementwise(model)


@needs_jax
def test_a_copy_runs_its_own_layers():
    """`kmp.convert` copies a model (deepcopy): the copy's stretches are its own layers',
    not the original's (a closure over the original graph would run the original)."""
    keras.utils.set_random_seed(0)
    model = WORKLOADS["tiny_gpt"].build(keras)
    kmp.recompute_elementwise(model)
    x, _ = WORKLOADS["tiny_gpt"].data(np.random.default_rng(0))
    copy = kmp.convert(model, "float32", check=None)
    want = keras.ops.convert_to_numpy(model(x))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(copy(x)), want, atol=1e-5)
    head = copy.get_layer("head")
    head.kernel.assign(np.zeros(head.kernel.shape, "float32"))
    got = keras.ops.convert_to_numpy(copy(x))
    bias = keras.ops.convert_to_numpy(head.bias)
    np.testing.assert_allclose(got, np.broadcast_to(bias, got.shape))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x)), want)  # untouched
