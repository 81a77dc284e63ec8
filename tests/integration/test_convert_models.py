"""keras_mp.convert on real architectures: keras.applications CNNs and a small transformer."""

import keras
import numpy as np
import pytest

import keras_mp as kmp

NORMS = (keras.layers.BatchNormalization, keras.layers.LayerNormalization)
MATMULS = (keras.layers.Conv2D, keras.layers.DepthwiseConv2D, keras.layers.EinsumDense)


def _relative_error(model, converted, x):
    # predict_on_batch: one compiled call (JAX runs eager calls op by op, ~6x slower here).
    reference = keras.ops.convert_to_numpy(model.predict_on_batch(x))
    result = converted.predict_on_batch(x)
    # The logits projection runs in the compute dtype; the converted model hands its
    # callers float32 (its outputs are cast at the model's boundary).
    assert keras.backend.standardize_dtype(result.dtype) == "float32"
    result = keras.ops.convert_to_numpy(keras.ops.cast(result, "float32"))
    return float(np.abs(result - reference).max() / np.abs(reference).max())


def _check_layers(model, converted, low, output_name):
    """Everything runs low: the logits head (a linear projection: FP32 accumulation, the loss
    up-casts), BN/LN (FP32 statistics inside), conv/matmul; master weights stay FP32."""
    counts = {"head": 0, "low": 0}
    for layer in converted._flatten_layers(include_self=False):
        variables = layer._trainable_variables + layer._non_trainable_variables
        if layer.name == output_name:
            assert layer.compute_dtype == low, layer.name
            counts["head"] += 1
        elif isinstance(layer, NORMS + MATMULS) or isinstance(layer, keras.layers.Dense):
            assert layer.compute_dtype == low, layer.name
            counts["low"] += 1
        assert all(v.dtype == "float32" for v in variables), layer.name  # master weights
    # Original untouched: float32 everywhere, weights bit-identical in the copy.
    assert {x.compute_dtype for x in model._flatten_layers()} == {"float32"}
    assert len(model.weights) == len(converted.weights)
    for a, b in zip(model.weights, converted.weights, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value)
        )
    return counts


@pytest.mark.tf_only  # CI time (2026-12-06): the JAX pass leaves it out
def test_convert_mobilenetv2():
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), alpha=0.35, classes=10, classifier_activation=None
    )
    converted = kmp.convert(model, "mixed_bfloat16")
    counts = _check_layers(model, converted, "bfloat16", output_name="predictions")
    assert counts == {"head": 1, "low": 52 + 35 + 17}  # head; BN + Conv2D + DepthwiseConv2D
    x = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")
    # An untrained MobileNetV2's logits are tiny (~3e-11: float16 would flush them to zero,
    # bfloat16 keeps FP32's range). Measured relative error: 2.1e-2 (8-bit mantissa, 50+ layers).
    assert _relative_error(model, converted, x) < 6e-2


@pytest.mark.slow
@pytest.mark.parametrize("policy, tolerance", [("mixed_bfloat16", 4e-2), ("mixed_float16", 4e-3)])
def test_convert_resnet50_logits_close(policy, tolerance):
    model = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None
    )
    converted = kmp.convert(model, policy)
    low = kmp.Policy(policy).compute_dtype
    counts = _check_layers(model, converted, low, output_name="predictions")
    assert counts == {"head": 1, "low": 53 + 53}  # head; BN + Conv2D
    x = np.random.default_rng(0).uniform(-1, 1, size=(4, 32, 32, 3)).astype("float32")
    # Measured on CPU: 8.9e-3 (bfloat16, 8-bit mantissa), 1.7e-3 (float16, 11-bit).
    assert _relative_error(model, converted, x) < tolerance


def _transformer(seq=16, vocab=50, dim=32, classes=4):
    inputs = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim, name="embed")(inputs)
    a = keras.layers.MultiHeadAttention(4, dim // 4, dropout=0.1, name="mha")(x, x)
    x = keras.layers.LayerNormalization(name="ln1")(x + a)
    f = keras.layers.Dense(64, activation="gelu", name="ffn_in")(x)
    f = keras.layers.Dense(dim, name="ffn_out")(f)
    x = keras.layers.LayerNormalization(name="ln2")(x + f)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    logits = keras.layers.Dense(classes, name="logits")(x)
    return keras.Model(inputs, logits, name="tiny_transformer")


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, size=(64, 16)).astype("int32")
    return x, (x[:, 0] % 4).astype("int32")


def test_convert_transformer_close_and_trains():
    model = _transformer()
    converted = kmp.convert(model, "mixed_bfloat16")
    counts = _check_layers(model, converted, "bfloat16", output_name="logits")
    assert counts == {"head": 1, "low": 2 + 2 + 4}  # logits; ln1, ln2, ffn, q/k/v/out
    mha = converted.get_layer("mha")
    assert isinstance(mha, kmp.layers.MultiHeadAttention)  # softmax in FP32 inside
    assert converted.get_layer("embed").compute_dtype == "bfloat16"
    x, y = _data()
    # Measured: 5.2e-3 (bfloat16).
    assert _relative_error(model, converted, x) < 2e-2
    converted.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    losses = converted.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0]
    assert converted.get_layer("ffn_in").kernel.dtype == "float32"


@pytest.mark.slow
@pytest.mark.tf_only
def test_convert_transformer_mixed_float16_trains_with_loss_scaling():
    converted = kmp.convert(_transformer(), "mixed_float16")
    converted.compile(
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(3e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    x, y = _data()
    losses = converted.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0]


def _language_model_losses(policy):
    """Four epochs of a 1-layer GPT (vocab 512) learning y = (7x + 3) mod 512, per-epoch loss."""
    from keras_mp.cli.workloads import GPT

    gpt = GPT(batch=8, seq=32, d_model=64, heads=4, layers=1, ffn=128, vocab=512)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 512, (256, 32)).astype("int32")
    keras.utils.set_random_seed(0)
    model = gpt.build(keras)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.Adam(3e-3)
    if policy != "float32":
        model = kmp.convert(model, policy)
        assert model.get_layer("head").compute_dtype == kmp.Policy(policy).compute_dtype
        loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
        if policy == "mixed_float16":
            optimizer = kmp.LossScaleOptimizer(optimizer)
    model.compile(optimizer, loss, jit_compile=True)
    history = model.fit(x, (x * 7 + 3) % 512, batch_size=32, epochs=4, verbose=0, shuffle=False)
    return np.array(history.history["loss"])


@pytest.mark.slow  # CI time (2026-12-06): runs with -m slow
def test_language_model_with_low_precision_head_trains_like_float32():
    """The default recipe (logits projection in the compute dtype, fused FP32 loss, FP32
    attention softmax) follows the FP32 loss curve: measured max |difference| 0.0005 (TF) /
    0.0018 (JAX) over four epochs falling from 6.06 to 2.75; FP16 (TF) 0.0001."""
    reference = _language_model_losses("float32")
    assert reference[-1] < 0.5 * reference[0]  # it learns
    policies = ["mixed_bfloat16"]
    if keras.backend.backend() == "tensorflow":  # JAX on CPU has no float16 dot
        policies.append("mixed_float16")
    for policy in policies:
        np.testing.assert_allclose(_language_model_losses(policy), reference, atol=0.01)
