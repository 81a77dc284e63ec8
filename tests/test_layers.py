"""Tests for keras_mp.layers: Float32 wrapper, float32 Softmax and MultiHeadAttention."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_mp import formats
from keras_mp import layers as kmp_layers

BACKEND = keras.backend.backend()
# JAX on CPU has no float16 dot: attention and dense comparisons use bfloat16 there.
LOW = "float16" if BACKEND == "tensorflow" else "bfloat16"


def _low_precision_run(fn, *args):
    """Runs `fn` the way low-precision kernels round: XLA on TF (as `fit(jit_compile=True)`
    runs it; TF's eager CPU softmax kernel computes float16 in float32 internally), and
    op by op on JAX (each op rounds its result to the low dtype, as on a GPU)."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True)(*args)
    return fn(*args)


def _np64(x):
    return np.asarray(ops.cast(x, "float32"), dtype=np.float64)


def _softmax64(x, mask=None, axis=-1):
    x = np.where(mask, x, -np.inf) if mask is not None else x
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0))
    s = e.sum(axis=axis, keepdims=True)
    return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def _dtype(x):
    return keras.backend.standardize_dtype(x.dtype)


# --------------------------------------------------------------------------- Softmax


@pytest.mark.parametrize("low", ["float16", "bfloat16"])
def test_softmax_over_4096_positions(low):
    """Softmax over 4096 logits ~ N(0, 8^2) given in `low`, vs a float64 reference.

    Measured (identical on TF+XLA and JAX eager, CPU), error in ulps of the exact result:
    - stock keras.layers.Softmax under "mixed_<low>": float16 max 1.6-2.2 ulp (max abs
      3.9e-4, ~500 of 32768 values not correctly rounded, row sums off by 4.8e-4);
      bfloat16 max 66 ulp (max abs 3.2e-3, 27307 of 32768 not correctly rounded).
    - ours: max 0.500 ulp (every value correctly rounded: float32 arithmetic, one final
      rounding), max abs 2.4e-4 (float16) / 1.9e-3 (bfloat16), i.e. exactly the float32
      result after casting.
    """
    keras.config.set_dtype_policy(f"mixed_{low}")
    rng = np.random.default_rng(0)
    x = ops.cast((rng.standard_normal((8, 4096)) * 8).astype(np.float32), low)
    ref = _softmax64(_np64(x))
    ulp = formats.ulp(ref, low)
    f32_cast = _np64(ops.cast(ops.softmax(ops.cast(x, "float32")), low))

    stock = _low_precision_run(keras.layers.Softmax(), x)
    ours = _low_precision_run(kmp_layers.Softmax(), x)
    assert _dtype(stock) == _dtype(ours) == low

    ours_ulps = np.abs(_np64(ours) - ref) / ulp
    stock_ulps = np.abs(_np64(stock) - ref) / ulp
    assert ours_ulps.max() <= 0.501
    assert np.abs(_np64(ours) - f32_cast).max() <= float(ulp.max())  # float32 result, cast
    assert stock_ulps.max() > 1.5
    assert (stock_ulps > 0.501).sum() > 100


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_softmax_masking(policy):
    keras.config.set_dtype_policy(policy)
    dtype = keras.DTypePolicy(policy).compute_dtype
    rng = np.random.default_rng(1)
    logits = ops.cast((rng.standard_normal((3, 5, 16)) * 8).astype(np.float32), dtype)
    mask = rng.random((3, 5, 16)) > 0.4
    mask[0, 2] = False  # a fully masked row
    mask[1, :, 0] = True

    out = kmp_layers.Softmax()(logits, mask=mask)
    assert _dtype(out) == dtype
    got, ref = _np64(out), _softmax64(_np64(logits), mask)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[~mask], 0.0)  # includes the fully masked row
    # Low dtypes: correctly rounded float32 results. float32 itself: exp(x - max) has
    # relative condition number |x - max| (up to ~50 here), hence rtol 1e-5.
    if dtype == "float32":
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=0)
    else:
        assert (np.abs(got - ref) <= 0.501 * formats.ulp(ref, dtype)).all()

    # A float 0/1 mask broadcast over rows, and a softmax over two axes.
    row_mask = ops.cast(mask[:, :1, :], dtype)
    np.testing.assert_array_equal(_np64(kmp_layers.Softmax()(logits, mask=row_mask)),
                                  _np64(kmp_layers.Softmax()(logits, mask=mask[:, :1, :])))
    two_axes = kmp_layers.Softmax(axis=(-2, -1))(logits, mask=mask)
    ref2 = _softmax64(_np64(logits), mask, axis=(-2, -1))
    if dtype == "float32":
        np.testing.assert_allclose(_np64(two_axes), ref2, rtol=1e-5, atol=0)
    else:  # exp(x - logsumexp) in float32, then one rounding
        assert (np.abs(_np64(two_axes) - ref2) <= 0.51 * formats.ulp(ref2, dtype)).all()

    layer = kmp_layers.Softmax(axis=(1, 2), name="probs")
    again = kmp_layers.Softmax.from_config(layer.get_config())
    assert again.axis == (1, 2) and again.name == "probs"


# ------------------------------------------------------------------ MultiHeadAttention


def _mha_pair(policy, seq=4, **kwargs):
    """A float32 stock MHA and `policy` versions of stock and ours with the same weights."""
    ref = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16, dtype="float32", **kwargs)
    x = np.zeros((1, seq, 64), "float32")
    ref(x, x)
    made = []
    for cls in (keras.layers.MultiHeadAttention, kmp_layers.MultiHeadAttention):
        config = dict(ref.get_config(), dtype=policy)
        layer = cls.from_config(config)
        layer(x, x)
        layer.set_weights(ref.get_weights())
        made.append(layer)
    return ref, *made


def test_mha_is_stock_mha_with_float32_softmax():
    ref, stock, ours = _mha_pair("float32", dropout=0.1)
    assert isinstance(ours, keras.layers.MultiHeadAttention)
    assert [w.path for w in ours.weights] == [w.path for w in stock.weights]
    softmaxes = [la for la in ours._flatten_layers() if isinstance(la, keras.layers.Softmax)]
    assert [type(la) for la in softmaxes] == [kmp_layers.Softmax]  # stock one not tracked
    assert ours.get_config() == dict(stock.get_config(), name=ours.name)

    x = np.random.default_rng(0).standard_normal((2, 7, 64)).astype("float32")
    for kwargs in ({}, {"return_attention_scores": True}, {"use_causal_mask": True}):
        want, got = stock(x, x, **kwargs), ours(x, x, **kwargs)
        for w, g in zip(keras.tree.flatten(want), keras.tree.flatten(got)):
            np.testing.assert_allclose(_np64(g), _np64(w), rtol=1e-6, atol=1e-6)


def test_mha_mixed_precision_closer_to_float32():
    """Same weights, T=128 self-attention, explicit-softmax path (return_attention_scores).

    Measured (TF+XLA float16 / JAX eager bfloat16; T=128 and 256, two seeds each), vs the
    float32 layer: output mean abs error stock 1.2e-4 / 9.5e-4, ours 7% lower (ratio
    0.92-0.94; the rest is the low-precision matmuls); probabilities mean abs error ours
    22-25% lower (ratio 0.75-0.78); rows sum to 1 within 5.1e-4 / 4.2e-3 (stock) vs
    1.4e-4 / 1.1e-3 (ours). The fused path (no scores requested) is the same Keras call
    for both layers and already keeps its softmax in float32: identical outputs.
    """
    ref, stock, ours = _mha_pair(f"mixed_{LOW}")
    x = np.random.default_rng(0).standard_normal((2, 128, 64)).astype("float32")
    want, want_p = (_np64(t) for t in ref(x, x, return_attention_scores=True))

    def attend(layer):
        return _low_precision_run(lambda t: layer(t, t, return_attention_scores=True), x)

    (s_out, s_p), (o_out, o_p) = attend(stock), attend(ours)
    assert _dtype(o_out) == _dtype(o_p) == LOW
    s_err, o_err = np.abs(_np64(s_out) - want).mean(), np.abs(_np64(o_out) - want).mean()
    assert o_err < 0.97 * s_err
    s_sum = np.abs(_np64(s_p).sum(-1) - 1).max()
    o_sum = np.abs(_np64(o_p).sum(-1) - 1).max()
    assert o_sum < s_sum / 3
    assert np.abs(_np64(o_p) - want_p).mean() < 0.85 * np.abs(_np64(s_p) - want_p).mean()

    np.testing.assert_array_equal(_np64(stock(x, x)), _np64(ours(x, x)))  # fused path


def test_mha_causal_and_fully_masked_rows():
    _, _, ours = _mha_pair(f"mixed_{LOW}", seq=6)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 6, 64)).astype("float32")
    changed = x.copy()
    changed[:, 3:] += 5.0  # change only the future of positions 0..2

    for kwargs in ({"use_causal_mask": True},  # fused path
                   {"use_causal_mask": True, "return_attention_scores": True}):  # ours
        a = keras.tree.flatten(ours(x, x, **kwargs))
        b = keras.tree.flatten(ours(changed, changed, **kwargs))
        np.testing.assert_array_equal(_np64(a[0])[:, :3], _np64(b[0])[:, :3])
    probs = _np64(a[1])
    assert (probs[..., np.triu_indices(6, k=1)[0], np.triu_indices(6, k=1)[1]] == 0).all()
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=6 * formats.info(LOW).epsilon)

    # A query row that may attend nowhere gives zeros (explicit path), never NaN.
    attention_mask = np.ones((2, 6, 6), bool)
    attention_mask[:, 1] = False
    out, probs = ours(x, x, attention_mask=attention_mask, return_attention_scores=True)
    assert not np.isnan(_np64(out)).any()
    np.testing.assert_array_equal(_np64(probs)[:, :, 1], 0.0)
    assert not np.isnan(_np64(ours(x, x, attention_mask=attention_mask))).any()  # fused


# --------------------------------------------------------------------------- Float32


def test_float32_wrapper_dtypes_values_and_weights():
    keras.config.set_dtype_policy(f"mixed_{LOW}")
    dense = keras.layers.Dense(8)
    wrapped = kmp_layers.Float32(dense)
    x = np.random.default_rng(3).standard_normal((4, 16)).astype("float32")
    y = wrapped(ops.cast(x, LOW))
    assert _dtype(y) == LOW
    assert [v.dtype for v in wrapped.weights] == ["float32", "float32"]
    assert wrapped.weights[0] is dense.kernel and len(wrapped.trainable_weights) == 2
    assert dense.compute_dtype == "float32"
    # Computed in float32 on the up-cast input, then rounded once to the low dtype.
    x_up = _np64(ops.cast(x, LOW))
    exact = x_up @ _np64(dense.kernel) + _np64(dense.bias)
    assert (np.abs(_np64(y) - exact) <= 0.501 * formats.ulp(exact, LOW) + 1e-5).all()

    logits = kmp_layers.Float32(keras.layers.Dense(3), output_dtype="float32")
    assert _dtype(logits(y)) == "float32"
    dropout = kmp_layers.Float32(keras.layers.Dropout(0.5))  # `training` reaches the layer
    assert (_np64(dropout(y, training=True)) == 0).sum() > 4
    np.testing.assert_array_equal(_np64(dropout(y, training=False)), _np64(y))

    with pytest.raises(ValueError, match="output_dtype.*Valid choices"):
        kmp_layers.Float32(keras.layers.Dense(3), output_dtype="float16")
    with pytest.raises(ValueError, match="`layer` must be a keras.layers.Layer"):
        kmp_layers.Float32(lambda t: t)
    built_low = keras.layers.Dense(3, dtype="float16", name="low_dense")
    built_low.build((None, 4))
    with pytest.raises(ValueError, match="'low_dense' is already built with"):
        kmp_layers.Float32(built_low)


def test_float32_keeps_masks():
    keras.config.set_dtype_policy(f"mixed_{LOW}")
    tokens = np.array([[3, 5, 0, 0], [7, 0, 0, 0]])
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(10, 8, mask_zero=True)(inputs)
    x = kmp_layers.Float32(keras.layers.Dense(8))(x)
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D()(x))
    per_token = keras.Model(inputs, x)(tokens)
    expected = [_np64(per_token)[0, :2].mean(0), _np64(per_token)[1, :1].mean(0)]
    np.testing.assert_allclose(_np64(model(tokens)), expected, rtol=1e-2, atol=1e-2)


def test_model_with_keras_mp_layers_saves_and_loads(tmp_path):
    keras.config.set_dtype_policy(f"mixed_{LOW}")
    inputs = keras.Input((6, 16))
    x = keras.layers.Dense(16)(inputs)
    x = kmp_layers.Float32(keras.layers.LayerNormalization())(x)
    x = kmp_layers.MultiHeadAttention(num_heads=2, key_dim=8)(x, x)
    x = kmp_layers.Float32(keras.layers.MultiHeadAttention(num_heads=2, key_dim=8))(x, x)
    x = kmp_layers.Softmax()(x)
    outputs = kmp_layers.Float32(keras.layers.Dense(4), output_dtype="float32")(x)
    model = keras.Model(inputs, outputs)
    x_in = np.random.default_rng(4).standard_normal((2, 6, 16)).astype("float32")
    expected = model(x_in)
    assert _dtype(expected) == "float32"

    model.save(tmp_path / "model.keras")
    keras.config.set_dtype_policy("float32")  # the file, not the global policy, decides
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert [type(la) for la in loaded.layers] == [type(la) for la in model.layers]
    np.testing.assert_array_equal(_np64(loaded(x_in)), _np64(expected))
    for a, b in zip(loaded.weights, model.weights):
        assert a.path == b.path and a.dtype == b.dtype
        np.testing.assert_array_equal(_np64(a), _np64(b))
    inner = [la.layer for la in loaded.layers if isinstance(la, kmp_layers.Float32)]
    assert {v.dtype for la in inner for v in la.weights} == {"float32"}
    assert {la.compute_dtype for la in inner} == {"float32"}


def _layer_norm_value_and_grads(layer, x, upstream):
    """(output, d input, d gamma, d beta) for `sum(output * upstream)`."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            total = tf.reduce_sum(tf.cast(y, "float32") * upstream)
        return (y, *tape.gradient(total, [x, layer.gamma.value, layer.beta.value]))
    import jax

    def f(x, gamma, beta):
        stateless = dict(zip([v.path for v in layer.trainable_variables], (gamma, beta)))
        y = layer.stateless_call([stateless[v.path] for v in layer.trainable_variables], [], x)[0]
        return ops.sum(ops.cast(y, "float32") * upstream), y

    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
        ops.convert_to_tensor(x), layer.gamma.value, layer.beta.value
    )
    return (y, *grads)


@pytest.mark.parametrize("shape", [(16, 32, 256), (1024, 128)])  # MIN_ELEMENTS: the TF kernel
def test_layer_norm_matches_keras_layer_values_and_gradients(shape):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 3 + 1).astype("float32")
    upstream = rng.standard_normal(shape).astype("float32")
    dtype = "mixed_bfloat16"
    ours = kmp_layers.LayerNormalization(epsilon=1e-3, dtype=dtype)
    stock = keras.layers.LayerNormalization(epsilon=1e-3, dtype=dtype)
    reference = keras.layers.LayerNormalization(epsilon=1e-3, dtype="float32")
    for layer in (ours, stock, reference):
        layer.build(shape)
        layer.gamma.assign(rng.uniform(0.5, 1.5, shape[-1:]).astype("float32"))
        layer.beta.assign(rng.uniform(-0.5, 0.5, shape[-1:]).astype("float32"))
        layer.set_weights(ours.get_weights())
    x_low = ops.convert_to_numpy(ops.cast(ops.cast(x, "bfloat16"), "float32"))
    want = [_np64(t) for t in _layer_norm_value_and_grads(reference, x_low, upstream)]
    assert ours._uses_tf_kernel(x) is (BACKEND == "tensorflow")
    got = _layer_norm_value_and_grads(ours, ops.cast(x_low, "bfloat16"), upstream)
    stock_got = _layer_norm_value_and_grads(stock, ops.cast(x_low, "bfloat16"), upstream)
    assert [_dtype(t) for t in got] == ["bfloat16", "bfloat16", "float32", "float32"]
    for g, s, w, name in zip(got, stock_got, want, ["y", "dx", "dgamma", "dbeta"]):
        # The output: one bfloat16 rounding of the float32 layer's. The gradients start from
        # the output gradient rounded to bfloat16 (also for Keras' layer): a few roundings.
        tol = {"y": 2.0**-8, "dx": 2.0**-6}.get(name, 2.0**-7)
        scale = np.abs(w).max()
        assert np.abs(_np64(g) - w).max() <= tol * scale, name
        assert np.abs(_np64(g) - w).max() <= 1.01 * np.abs(_np64(s) - w).max() + 1e-6 * scale


def test_layer_norm_is_keras_config_and_weights():
    stock = keras.layers.LayerNormalization(epsilon=1e-5, center=False, name="ln")
    ours = kmp_layers.LayerNormalization.from_config(stock.get_config())
    assert ours.get_config() == stock.get_config()
    stock.build((2, 8))
    ours.build((2, 8))
    assert [w.path for w in ours.weights] == [w.path for w in stock.weights]
    x = np.random.default_rng(1).standard_normal((2, 8)).astype("float32")
    np.testing.assert_allclose(_np64(ours(x)), _np64(stock(x)), atol=1e-6)  # float32: Keras'


def test_layer_norm_below_the_kernel_size_is_keras_layer_exactly():
    x = np.random.default_rng(4).standard_normal((4, 6, 32)).astype("float32")
    ours = kmp_layers.LayerNormalization(dtype="mixed_bfloat16")
    stock = keras.layers.LayerNormalization(dtype="mixed_bfloat16")
    for layer in (ours, stock):
        layer.build(x.shape)
    assert not ours._uses_tf_kernel(x)
    np.testing.assert_array_equal(_np64(ours(x)), _np64(stock(x)))


@pytest.mark.tf_only
def test_layer_norm_kernel_only_where_inner_axes_are_known():
    """An unknown batch axis (how `fit` traces its step) takes the kernel; an unknown
    sequence axis (padding per batch) takes Keras' layer: XLA would compile the kernel again
    for every new length."""
    import tensorflow as tf

    ours = kmp_layers.LayerNormalization(dtype="mixed_bfloat16")
    ours.build((None, None, 512))
    assert ours._uses_tf_kernel(tf.TensorSpec((None, 256, 512), tf.bfloat16))
    assert not ours._uses_tf_kernel(tf.TensorSpec((None, None, 512), tf.bfloat16))
    assert not ours._uses_tf_kernel(tf.TensorSpec((8, None, 512), tf.bfloat16))


@pytest.mark.parametrize("policy", ["bfloat16", LOW])
def test_layer_norm_under_a_pure_policy_matches_keras(policy):
    """Pure float16/bfloat16: the variables are low precision too (used in float32)."""
    x = np.random.default_rng(5).standard_normal((16, 32, 256)).astype("float32")
    ours = kmp_layers.LayerNormalization(dtype=policy)
    stock = keras.layers.LayerNormalization(dtype=policy)
    for layer in (ours, stock):
        layer.build(x.shape)
        layer.gamma.assign(np.linspace(0.5, 1.5, 256))
    got, want = _np64(ours(x)), _np64(stock(x))
    assert _dtype(ours(x)) == policy
    np.testing.assert_allclose(got, want, atol=2 * 2.0**-7 * np.abs(want).max())


@pytest.mark.tf_only
@pytest.mark.parametrize("center,scale", [(True, True), (False, True), (True, False)])
def test_layer_norm_trains_in_graph_and_xla_with_optional_parameters(center, scale):
    keras.config.set_dtype_policy("mixed_bfloat16")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 64, 32)).astype("float32")
    y = rng.standard_normal((32, 64, 256)).astype("float32")
    losses = {}
    for cls, jit in ((kmp_layers.LayerNormalization, False), (kmp_layers.LayerNormalization,
                     True), (keras.layers.LayerNormalization, False)):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64, 32))
        h = keras.layers.Dense(256)(inputs)  # batches of 8 x 64 x 256: the TF kernel's size
        out = cls(center=center, scale=scale)(h)
        model = keras.Model(inputs, keras.layers.Dense(256, dtype="float32")(out))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit)
        hist = model.fit(x, y, epochs=3, batch_size=8, verbose=0, shuffle=False)
        losses[(cls.__module__, jit)] = hist.history["loss"]
    ours, ours_xla, stock = losses.values()
    assert ours[-1] < ours[0]
    np.testing.assert_allclose(ours, stock, rtol=0.02)
    np.testing.assert_allclose(ours_xla, stock, rtol=0.02)


@pytest.mark.tf_only
def test_layer_norm_and_gelu_kernels_need_less_temporary_memory_than_keras():
    """TF allocator peak of value-and-gradients in a tf.function, above what is in use before,
    in units of the 4096 x 1024 bfloat16 input: measured layer norm 4.0x (rows in blocks;
    17x in one block: XLA:CPU materialises float32 reduction inputs) vs Keras' 10.0x, GELU
    1.0x vs Keras' 4.0x. The peaks move by about one input from machine to machine, as the
    executor overlaps ops (CI's 2-core runners: GELU 1.94x vs 4.94x, and 1.0x vs 3.0x under
    Keras 3.12), so GELU is held to 2 inputs less and at most two thirds of Keras'."""
    import tensorflow as tf

    from keras_mp.numerics.activations import gelu

    n, d = 4096, 1024
    x = tf.cast(tf.random.stateless_normal([n, d], seed=[1, 2]), "bfloat16")

    def peak(fn, params=()):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                total = tf.reduce_sum(tf.cast(fn(x), "float32"))
            return tape.gradient(total, [x, *params])

        step(x)
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        grads = step(x)
        assert all(g is not None for g in grads)
        return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / (n * d * 2)

    norms = []
    for cls in (kmp_layers.LayerNormalization, keras.layers.LayerNormalization):
        layer = cls(dtype="mixed_bfloat16")
        layer.build((n, d))
        norms.append(peak(layer, [v.value for v in layer.trainable_variables]))
    ours, stock = norms
    assert ours <= 5.0 and ours <= 0.6 * stock, (ours, stock)
    ours, stock = peak(gelu), peak(keras.activations.gelu)
    assert stock - ours >= 2.0 and ours <= 2.0 and ours <= 0.67 * stock, (ours, stock)


@pytest.mark.tf_only
@pytest.mark.parametrize("known_rows", [True, False])
def test_layer_norm_kernel_in_blocks_of_rows_matches_one_block(known_rows):
    """37 x 3 rows of 16 in blocks of 4 rows (the last one shorter), in a graph with known or
    unknown row count: the same values and gradients as one block."""
    import tensorflow as tf

    from keras_mp.tf.normalization import layer_norm_float32_math

    rng = np.random.default_rng(3)
    x = tf.constant(rng.standard_normal((37, 3, 16)) * 2 + 1, tf.bfloat16)
    upstream = tf.constant(rng.standard_normal((37, 3, 16)), tf.bfloat16)
    gamma = tf.constant(rng.uniform(0.5, 1.5, 16), tf.float32)
    beta = tf.constant(rng.uniform(-0.5, 0.5, 16), tf.float32)
    spec = [tf.TensorSpec([37 if known_rows else None, 3, 16], tf.bfloat16)]

    def value_and_grads(block_elements):
        @tf.function(input_signature=spec)
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch([x, gamma, beta])
                y = layer_norm_float32_math(x, gamma, beta, 1e-3, block_elements)
            return (y, *tape.gradient(y, [x, gamma, beta], output_gradients=upstream))

        return [_np64(t) for t in run(x)]

    blocked, whole = value_and_grads(64), value_and_grads(2**20)
    for b, w in zip(blocked, whole, strict=True):
        np.testing.assert_allclose(b, w, rtol=1e-6, atol=1e-6)
    normalised = (whole[0] - beta.numpy()) / gamma.numpy()  # rows: mean 0, deviation 1
    assert np.abs(normalised.mean(-1)).max() < 0.02
    assert np.abs(normalised.std(-1) - 1).max() < 0.02
