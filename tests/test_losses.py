"""Tests for keras_mp.losses: float32 cross-entropy whatever the prediction dtype."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_mp import losses

RNG = np.random.default_rng(0)
N, C = 64, 200  # C < 256: integer labels stay exact even in bfloat16 (see below)
LOGITS = (RNG.standard_normal((N, C)) * 20).astype(np.float32)  # "large" logits, |x| up to ~80
LABELS = RNG.integers(0, C, N)
ONE_HOT = np.eye(C, dtype=np.float32)[LABELS]
BIN_LOGITS = (RNG.standard_normal((N, 16)) * 30).astype(np.float32)
BIN_LABELS = (RNG.random((N, 16)) > 0.5).astype(np.float32)
WEIGHTS = RNG.random(N).astype(np.float32)


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


def _softmax64(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# (ours, stock, y_true, y_pred, kwargs) covering logits/probabilities, label smoothing,
# ignore_class and every reduction.
CASES = [
    ("SparseCategoricalCrossentropy", LABELS, LOGITS, dict(from_logits=True)),
    ("SparseCategoricalCrossentropy", LABELS, _softmax64(LOGITS / 20), {}),
    ("SparseCategoricalCrossentropy", LABELS, LOGITS,
     dict(from_logits=True, ignore_class=int(LABELS[0]), reduction="sum")),
    ("CategoricalCrossentropy", ONE_HOT, LOGITS, dict(from_logits=True, label_smoothing=0.1)),
    ("CategoricalCrossentropy", ONE_HOT, _softmax64(LOGITS / 20), dict(reduction=None)),
    ("BinaryCrossentropy", BIN_LABELS, BIN_LOGITS, dict(from_logits=True, label_smoothing=0.2)),
    ("BinaryCrossentropy", BIN_LABELS, 1 / (1 + np.exp(-BIN_LOGITS / 30)),
     dict(reduction="mean_with_sample_weight")),
]


def test_equal_to_keras_on_float32_inputs():
    for cls_name, y_true, y_pred, kwargs in CASES:
        y_pred = y_pred.astype(np.float32)
        ours = getattr(losses, cls_name)(**kwargs)
        stock = getattr(keras.losses, cls_name)(**kwargs)
        assert isinstance(ours, type(stock))
        for sample_weight in (None, WEIGHTS):
            got = ours(y_true, y_pred, sample_weight=sample_weight)
            want = stock(y_true, y_pred, sample_weight=sample_weight)
            assert _dtype(got) == _dtype(want) == "float32"
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=str(kwargs))


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_large_logits_in_low_precision(low):
    """Keras' loss computed in the low dtype vs ours vs a float64 reference.

    Measured with this data (64 rows, 200 classes, logits ~ N(0, 20^2)), TF / JAX CPU:
    - from logits (mean loss ~49.6): Keras with dtype=low, per-sample error up to
      0.031-0.046 (float16) / 0.42 (bfloat16), mean relative error 1.8e-4 / 1.7e-3;
      ours per-sample <= 3.8e-6 (float32 rounding of ~50), mean <= 1.3e-7 relative.
    - from probabilities stored in the low dtype (mean loss ~16): Keras relative error
      1.0e-2 (float16) / 1.6e-3 (bfloat16), as its 1e-7 clip, log and mean round in the
      low dtype; ours <= 5e-6.
    """
    x_low = ops.cast(LOGITS, low)
    x64 = np.asarray(ops.cast(x_low, "float32"), dtype=np.float64)  # the values both see
    lse = np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1)) + x64.max(-1)
    ref = lse - x64[np.arange(N), LABELS]

    ours = losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    stock = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None,
                                                       dtype=low)
    ours_v = ours(LABELS, x_low)
    assert _dtype(ours_v) == "float32"
    ours_err = np.abs(np.asarray(ours_v, np.float64) - ref).max()
    stock_err = np.abs(np.asarray(ops.cast(stock(LABELS, x_low), "float32"), np.float64)
                       - ref).max()
    assert ours_err < 1e-5
    assert stock_err > 1e-2 > 100 * ours_err

    mean = losses.SparseCategoricalCrossentropy(from_logits=True)(LABELS, x_low)
    assert _dtype(mean) == "float32"
    assert abs(float(mean) - ref.mean()) / ref.mean() < 1e-6

    # From probabilities stored in the low dtype.
    p_low = ops.cast(ops.softmax(ops.cast(x_low, "float32")), low)
    p64 = np.asarray(ops.cast(p_low, "float32"), dtype=np.float64)
    ref_p = np.mean(-np.log(np.clip(p64[np.arange(N), LABELS], 1e-7, 1.0)))
    ours_p = float(losses.SparseCategoricalCrossentropy()(LABELS, p_low))
    stock_p = float(keras.losses.SparseCategoricalCrossentropy(dtype=low)(LABELS, p_low))
    assert abs(ours_p - ref_p) / ref_p < 1e-5
    assert abs(stock_p - ref_p) / ref_p > 1e-3

    # Categorical and binary from low-precision logits stay float32-accurate too.
    cce = losses.CategoricalCrossentropy(from_logits=True)(ONE_HOT, x_low)
    np.testing.assert_allclose(float(cce), ref.mean(), rtol=1e-6)
    b64 = np.asarray(ops.cast(ops.cast(BIN_LOGITS, low), "float32"), dtype=np.float64)
    ref_b = np.mean(np.maximum(b64, 0) - b64 * BIN_LABELS + np.log1p(np.exp(-np.abs(b64))))
    bce = losses.BinaryCrossentropy(from_logits=True)(BIN_LABELS, ops.cast(BIN_LOGITS, low))
    assert _dtype(bce) == "float32"
    np.testing.assert_allclose(float(bce), ref_b, rtol=1e-6)


def test_labels_above_256_stay_exact_with_bfloat16_predictions():
    # Keras' loss with dtype="bfloat16" also converts the integer labels to bfloat16, so
    # label 999 becomes 1000 (TF then raises "label value 1000 outside [0, 1000)", JAX
    # silently picks the wrong class). Ours converts labels to float32: exact up to 2**24.
    classes = 1000
    logits = ops.cast(RNG.standard_normal((8, classes)).astype(np.float32), "bfloat16")
    labels = np.array([999, 997, 513, 257, 3, 0, 998, 600])
    x64 = np.asarray(ops.cast(logits, "float32"), dtype=np.float64)
    ref = np.log(np.exp(x64).sum(-1)) - x64[np.arange(8), labels]
    got = losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(labels, logits)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6)


def test_dtype_is_always_float32():
    assert losses.BinaryCrossentropy(dtype="float32").dtype == "float32"
    for cls in (losses.SparseCategoricalCrossentropy, losses.CategoricalCrossentropy,
                losses.BinaryCrossentropy):
        with pytest.raises(ValueError, match=r"always computes in float32.*'float16'"):
            cls(dtype="float16")
        with pytest.raises(ValueError, match="Valid choices"):
            cls(dtype="mixed_bfloat16")

    keras.config.set_floatx("float16")
    try:
        loss = losses.CategoricalCrossentropy(from_logits=True)
        value = loss(ONE_HOT, LOGITS.astype(np.float16))
        stock = keras.losses.CategoricalCrossentropy(from_logits=True)
        stock_value = stock(ONE_HOT, LOGITS.astype(np.float16))
    finally:
        keras.config.set_floatx("float32")
    assert loss.dtype == _dtype(value) == "float32"
    assert _dtype(stock_value) == "float16"  # what we protect against


def test_serialization_round_trip():
    for cls_name, _, _, kwargs in CASES:
        loss = getattr(losses, cls_name)(name="my_loss", **kwargs)
        config = loss.get_config()
        again = type(loss).from_config(config)
        assert again.get_config() == config
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(loss))
        assert type(restored) is type(loss)
        assert restored.get_config() == config
    sparse = losses.SparseCategoricalCrossentropy(axis=1, ignore_class=-1)
    assert sparse.get_config()["axis"] == 1  # Keras 3.15 drops `axis` from this config
    assert type(sparse).from_config(sparse.get_config()).axis == 1


# --- The fused sparse cross-entropy from logits ----------------------------------------

SEQ_LOGITS = (RNG.standard_normal((3, 7, 300)) * 8).astype(np.float32)
SEQ_LABELS = RNG.integers(0, 300, (3, 7))
SEQ_LABELS[0, :2] = 5  # the ignored class below
SEQ_WEIGHTS = RNG.random((3, 7)).astype(np.float32)


def _value_and_grad(fn, x):
    """(fn(x), d fn / dx) through the backend's autodiff."""
    if keras.backend.backend() == "jax":
        import jax

        value, grad = jax.jit(jax.value_and_grad(fn))(x)
        return np.asarray(value, np.float64), grad
    import tensorflow as tf

    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        value = fn(x)
    return value.numpy().astype(np.float64), tape.gradient(value, x)


def _reference64(labels, logits, ignore, weights):
    """float64 numpy cross-entropy (sum over valid positions of weight * loss) and its grad."""
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    w = weights * (labels != ignore)
    picked = np.take_along_axis(z, labels[..., None], -1)[..., 0]
    grad = np.exp(z - lse[..., None]) - np.eye(z.shape[-1])[labels]
    return (w * (lse - picked)).sum(), grad * w[..., None]


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(ignore_class=5), dict(reduction="sum"), dict(reduction=None)],
    ids=["mean", "ignore_class", "sum", "none"],
)
def test_fused_sparse_equals_keras_values(kwargs):
    """The fused path (from_logits, class axis last) gives Keras' float32 values for every
    reduction, with sample weights, ignore_class, and (B, T, 1)-shaped labels."""
    ours = losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)
    stock = keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)
    for labels in (SEQ_LABELS, SEQ_LABELS[..., None]):
        got = ops.convert_to_numpy(ours(labels, SEQ_LOGITS, sample_weight=SEQ_WEIGHTS))
        want = ops.convert_to_numpy(stock(labels, SEQ_LOGITS, sample_weight=SEQ_WEIGHTS))
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def _fused_sum(z):
    per_position = losses.sparse_categorical_crossentropy_from_logits(SEQ_LABELS, z, 5)
    return ops.sum(per_position * SEQ_WEIGHTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("api", ["class", "function"])
def test_fused_sparse_gradient_matches_float64_reference(dtype, api):
    """Loss and gradient against float64 numpy: the gradient (softmax - one_hot, zero at the
    ignored class, times the sample weight) comes back in the logits' dtype, within float32
    rounding, or one bfloat16 ulp of |g| <= 1 (2^-8) for bfloat16 logits. Both run the fused
    loss (on TensorFlow the chunked oneDNN version, on JAX the XLA one)."""
    logits = ops.cast(SEQ_LOGITS, dtype)
    exact_logits = ops.convert_to_numpy(ops.cast(logits, "float32")).astype(np.float64)
    loss = losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=5, reduction="sum"
    )
    fn = _fused_sum if api == "function" else (
        lambda z: loss(SEQ_LABELS, z, sample_weight=SEQ_WEIGHTS)
    )
    value, grad = _value_and_grad(fn, logits)
    want_value, want_grad = _reference64(SEQ_LABELS, exact_logits, 5, SEQ_WEIGHTS)
    assert _dtype(grad) == dtype
    grad = ops.convert_to_numpy(ops.cast(grad, "float32"))
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, atol=1e-6 if dtype == "float32" else 2**-8)
    assert np.all(grad[0, :2] == 0)  # ignored positions get no gradient


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA memory analysis via JAX")
def test_fused_sparse_keeps_no_float32_logits_buffer():
    """Compiled loss-and-gradient of bfloat16 logits (2048 x 8192), by XLA's buffer
    assignment (not timing): the fused loss needs one logits-sized float32 temporary (XLA:CPU
    materialises the up-cast in front of its reduction kernel; XLA:GPU fuses it), Keras' loss
    three (a float32 copy, the float32 softmax kept for the backward pass, its gradient)."""
    import jax
    import jax.numpy as jnp

    n, v = 2048, 8192
    args = (jax.ShapeDtypeStruct((n, v), jnp.bfloat16), jax.ShapeDtypeStruct((n,), jnp.int32))

    def temp_bytes(loss):
        f = jax.value_and_grad(lambda z, y: loss(y, z))
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    bf16_logits = n * v * 2
    ours = temp_bytes(losses.SparseCategoricalCrossentropy(from_logits=True))
    stock = temp_bytes(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert ours <= 2.1 * bf16_logits, ours / bf16_logits
    assert stock >= 5.9 * bf16_logits, stock / bf16_logits


def test_fused_sparse_follows_keras_on_a_masked_sequence_model():
    """Padding positions masked by Embedding(mask_zero=True) reach the loss as a Keras mask:
    the fused loss trains a bfloat16 model exactly as Keras' loss does (per-epoch losses)."""
    import keras_mp as kmp

    rng = np.random.default_rng(0)
    x = rng.integers(1, 64, (64, 12)).astype("int32")
    x[:, 9:] = 0  # padding
    y = (x * 3 + 1) % 64

    def history(loss):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((12,), dtype="int32")
        h = keras.layers.Embedding(64, 16, mask_zero=True)(inputs)
        h = keras.layers.Dense(32, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(64, name="head")(h))
        model = kmp.convert(model, "mixed_bfloat16")
        model.compile(keras.optimizers.Adam(1e-2), loss)
        return model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False).history["loss"]

    ours = history(losses.SparseCategoricalCrossentropy(from_logits=True))
    stock = history(keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert ours[-1] < ours[0]
    np.testing.assert_allclose(ours, stock, atol=1e-3)  # measured (JAX): <= 1e-4


# --- TensorFlow: the chunked kernel (keras_mp.tf.losses) --------------------------------


def _chunked_case(dtype, rows, classes=300, seed=1):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((rows, classes)) * 8).astype(np.float32)
    y = rng.integers(0, classes, rows).astype(np.int32)
    z[0] = -50.0
    z[0, 3] = 60.0  # row 0: the label's probability, exp(-110), underflows float32
    y[0] = 4
    import tensorflow as tf

    z = tf.cast(z, dtype)
    z64 = tf.cast(z, "float64").numpy()
    top = z64.max(-1)
    lse = np.log(np.exp(z64 - top[:, None]).sum(-1)) + top
    weights = rng.random(rows)
    grad = (np.exp(z64 - lse[:, None]) - np.eye(classes)[y]) * weights[:, None]
    return z, y, weights, lse - z64[np.arange(rows), y], grad


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow kernel")
@pytest.mark.parametrize("mode", ["eager", "graph_unknown_rows", "xla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tf_chunked_loss_matches_float64_over_many_chunks(mode, dtype):
    """22 rows (bfloat16 logits: in chunks of 3, 8 chunks, the last one padded; float32
    logits: one piece), in eager mode, in a graph that does not know the row count, and under
    XLA: float32 losses within 1e-6 of float64 (also
    where the label's probability underflows: loss 110, gradient -weight at the label), the
    gradient in the logits' dtype within float32 rounding or one bfloat16 ulp of |g| <= 1."""
    import tensorflow as tf

    from keras_mp.tf.losses import sparse_xent_from_logits

    z, y, weights, want, want_grad = _chunked_case(dtype, rows=22)
    weights_t = tf.constant(weights, "float32")

    def value_and_grad(z, y):
        with tf.GradientTape() as tape:
            tape.watch(z)
            per_row = sparse_xent_from_logits(y, z, chunk_elements=1000)  # 3 rows a chunk
            total = tf.reduce_sum(per_row * weights_t)
        return per_row, tape.gradient(total, z)

    if mode == "graph_unknown_rows":
        spec = [tf.TensorSpec([None, 300], dtype), tf.TensorSpec([None], "int32")]
        value_and_grad = tf.function(value_and_grad, input_signature=spec)
    elif mode == "xla":
        value_and_grad = tf.function(value_and_grad, jit_compile=True)
    per_row, grad = value_and_grad(z, tf.constant(y))
    assert per_row.dtype == "float32" and grad.dtype == dtype
    np.testing.assert_allclose(per_row.numpy(), want, rtol=1e-6, atol=1e-6)
    assert abs(want[0] - 110.0) < 1e-3
    grad = tf.cast(grad, "float64").numpy()
    np.testing.assert_allclose(grad, want_grad, atol=1e-6 if dtype == "float32" else 2**-8)
    assert grad[0, 4] == pytest.approx(-weights[0], rel=2**-8)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow kernel")
def test_tf_loss_takes_the_xla_formulation_inside_jit_compile():
    """Inside `jit_compile=True` the loss is the keras.ops formulation (XLA fuses it whole),
    outside it the chunked loop; both give the same value."""
    import tensorflow as tf

    from keras_mp.tf.losses import compiling_with_xla

    seen = []

    def probe(z):
        seen.append(compiling_with_xla())
        return losses.sparse_categorical_crossentropy_from_logits(SEQ_LABELS, z)

    eager = probe(tf.constant(SEQ_LOGITS))
    xla = tf.function(probe, jit_compile=True)(tf.constant(SEQ_LOGITS))
    graph = tf.function(probe)(tf.constant(SEQ_LOGITS))
    assert seen == [False, True, False]
    np.testing.assert_allclose(xla.numpy(), eager.numpy(), rtol=1e-6)
    np.testing.assert_allclose(graph.numpy(), eager.numpy(), rtol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow kernel")
def test_tf_chunked_loss_rejects_unknown_class_count():
    import tensorflow as tf

    from keras_mp.tf.losses import sparse_xent_from_logits

    spec = [tf.TensorSpec([4], "int32"), tf.TensorSpec([4, None])]  # (labels, logits)
    with pytest.raises(ValueError, match="class axis of the logits must have a known size"):
        tf.function(sparse_xent_from_logits, input_signature=spec).get_concrete_function()


def _tf_loss_and_grad_peak(loss, y, z):
    """(mean loss, its gradient for `z`, TF allocator peak bytes above what was in use
    before) of a second call of a tf.function computing both (the first one traces)."""
    import tensorflow as tf

    @tf.function
    def step(z):
        with tf.GradientTape() as tape:
            tape.watch(z)
            value = tf.reduce_mean(loss(y, z))
        return value, tape.gradient(value, z)

    step(z)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    value, grad = step(z)
    return value, grad, tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow kernel")
def test_tf_chunked_loss_keeps_float32_temporaries_to_a_chunk():
    """TF allocator peak (tensors, `get_memory_info`) of loss-and-gradient of bfloat16 logits
    (2048 x 8192, 32 MiB) in a tf.function, above what is in use before: measured 2.25-2.9x the
    logits (the bfloat16 gradient, its chunks before the concat, two chunks' float32
    temporaries) against 3.0x for Keras' loss (float32 copy and float32 gradient) and 4.0x for
    the same loss in one chunk."""
    import tensorflow as tf

    from keras_mp.tf.losses import sparse_xent_from_logits

    n, v = 2048, 8192
    z = tf.cast(tf.random.stateless_normal([n, v], seed=[1, 2]), "bfloat16")
    y = tf.constant(np.random.default_rng(0).integers(0, v, n), "int32")

    def peak(loss):
        value, grad, peak_bytes = _tf_loss_and_grad_peak(loss, y, z)
        assert grad.dtype == "bfloat16" and np.isfinite(value.numpy())
        return peak_bytes / (n * v * 2)

    ours = peak(sparse_xent_from_logits)
    one_chunk = peak(lambda y, z: sparse_xent_from_logits(y, z, chunk_elements=n * v))
    stock = peak(keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
    assert ours <= 3.0 and ours <= stock, (ours, stock)
    assert one_chunk >= 3.9, one_chunk


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow kernel")
def test_tf_loss_on_float32_logits_writes_its_gradient_in_one_piece():
    """float32 logits (2048 x 8192, 64 MiB): nothing to up-cast, so no chunks: loss and
    gradient need 2x the logits (the gradient and one softmax) above what is in use before;
    in chunks they needed 2.9x (the gradient's chunks, then their concatenation)."""
    import tensorflow as tf

    from keras_mp.tf.losses import sparse_xent_from_logits

    n, v = 2048, 8192
    z = tf.random.stateless_normal([n, v], seed=[1, 2])
    y = tf.constant(np.random.default_rng(0).integers(0, v, n), "int32")
    value, grad, peak_bytes = _tf_loss_and_grad_peak(sparse_xent_from_logits, y, z)
    peak = peak_bytes / (n * v * 4)
    want = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, z)
    np.testing.assert_allclose(value.numpy(), keras.ops.convert_to_numpy(want), rtol=1e-6)
    assert grad.dtype == "float32" and peak <= 2.1, peak


@pytest.mark.slow
@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow kernel")
def test_tf_train_step_with_the_fused_loss_needs_no_more_tensor_memory_than_stock():
    """The cpu_gpt benchmark's bfloat16 train step (2048 x 8192 logits), TF allocator peak over
    the timed steps: keras_mp's (bfloat16 head, chunked fused loss) within 3% of stock Keras'
    (same head, TF's native loss on a float32 copy) or below. Measured 367-377 vs 377-386 MiB;
    without the backward loop's wait for the forward's log-sum-exps 400-411 vs 383-396."""
    import json
    import subprocess
    import sys

    # The harness, as a user runs it: each configuration in a fresh process.
    command = [sys.executable, "-m", "keras_mp.cli.benchmark", "--models", "cpu_gpt",
               "--policies", "stock_mixed_bfloat16@nojit,keras_mp_mixed_bfloat16@nojit",
               "--steps", "2", "--warmup", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    stock, ours = (json.loads(line) for line in done.stdout.splitlines())
    assert ours["tensor_peak_mib"] <= 1.03 * stock["tensor_peak_mib"], (ours, stock)
    assert abs(ours["loss"] - stock["loss"]) < 1e-3  # same model, same first steps


@pytest.mark.parametrize("from_logits", [True, False])
def test_one_hot_labels_into_the_sparse_loss_name_the_rank_mismatch(from_logits):
    """One-hot labels are refused before the fused path, with the fix named (before: "Dimensions
    must be equal, 64 and 200" from inside TensorFlow on the fused path)."""
    loss = losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    with pytest.raises(ValueError, match="rank|one dimension less|same shape") as info:
        loss(ONE_HOT, LOGITS if from_logits else _softmax64(LOGITS / 20).astype("float32"))
    if from_logits:
        assert "CategoricalCrossentropy" in str(info.value) and "(64, 200)" in str(info.value)
    with pytest.raises(ValueError, match=r"labels of shape \(32,\)"):
        loss(LABELS[:32], LOGITS)  # a batch-size mismatch names both shapes too


def test_sparse_attributes_and_config_on_every_keras():
    """Keras 3.16 keeps `from_logits`/`ignore_class` only inside its wrapped function: ours
    keeps them as attributes (the fused path reads them) and in the config."""
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=3, axis=-1)
    assert (loss.from_logits, loss.ignore_class, loss.axis) == (True, 3, -1)
    config = loss.get_config()
    assert config["from_logits"] is True and config["ignore_class"] == 3
    assert "label_smoothing" not in config  # loadable by Keras versions without it
    again = losses.SparseCategoricalCrossentropy.from_config(config)
    np.testing.assert_allclose(again(LABELS, LOGITS), loss(LABELS, LOGITS), rtol=1e-7)


def test_sparse_label_smoothing_follows_keras_where_keras_has_it():
    import inspect

    stock_takes_it = "label_smoothing" in inspect.signature(
        keras.losses.SparseCategoricalCrossentropy.__init__
    ).parameters
    if not stock_takes_it:
        with pytest.raises(ValueError, match="label_smoothing.*Keras 3.16"):
            losses.SparseCategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
        return
    ours = losses.SparseCategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    stock = keras.losses.SparseCategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    np.testing.assert_allclose(ours(LABELS, LOGITS), stock(LABELS, LOGITS), rtol=1e-6)
    assert ours.get_config()["label_smoothing"] == 0.1
