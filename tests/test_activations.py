"""keras_mp.activations.gelu: float32 math for low precision, keeping only its input."""

import math

import keras
import ml_dtypes
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.numerics.activations import gelu

X = np.linspace(-9.0, 9.0, 2**14 + 1)  # enough values for the TF kernel (MIN_ELEMENTS)
BF16 = ml_dtypes.bfloat16


def _reference(x: np.ndarray, approximate: bool):
    """float64 GELU and its derivative."""
    if approximate:
        c = math.sqrt(2 / math.pi)
        cdf = 1 / (1 + np.exp(-2 * c * (x + 0.044715 * x**3)))  # 0.5 * (1 + tanh(u))
        return x * cdf, cdf + x * 2 * cdf * (1 - cdf) * c * (1 + 3 * 0.044715 * x**2)
    cdf = 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2))  # erfc: no cancellation at -9
    return x * cdf, cdf + x * np.exp(-0.5 * x**2) / math.sqrt(2 * math.pi)


def _ulps(got, want, dtype):
    """|got - want| in units of the dtype's spacing at `want` (float64 arithmetic)."""
    info = ml_dtypes.finfo(dtype)
    exponent = np.floor(np.log2(np.maximum(np.abs(want), float(info.smallest_normal))))
    return np.abs(np.asarray(got, np.float64) - want) / 2.0 ** (exponent - info.nmant)


def _value_and_grad(fn, x, upstream):
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return y, tape.gradient(y, x, output_gradients=upstream)
    import jax

    y, vjp = jax.vjp(fn, x)
    return y, vjp(upstream)[0]


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gelu_value_and_gradient_within_one_ulp_of_float64(dtype, approximate):
    if keras.backend.backend() == "jax" and dtype == "float16":
        pytest.skip("JAX on CPU: no float16 arithmetic worth testing")
    np_dtype = np.dtype(getattr(ml_dtypes, dtype, dtype))
    x_low = X.astype(np_dtype)
    upstream_low = np.linspace(-2, 2, X.size).astype(np_dtype)
    want_y, want_slope = _reference(x_low.astype(np.float64), approximate)
    want_dx = upstream_low.astype(np.float64) * want_slope
    y, dx = _value_and_grad(
        lambda t: gelu(t, approximate),
        keras.ops.convert_to_tensor(x_low),
        keras.ops.convert_to_tensor(upstream_low),
    )
    assert keras.backend.standardize_dtype(y.dtype) == dtype
    assert keras.backend.standardize_dtype(dx.dtype) == dtype
    y_err = _ulps(keras.ops.convert_to_numpy(keras.ops.cast(y, "float32")), want_y, np_dtype)
    dx_err = _ulps(keras.ops.convert_to_numpy(keras.ops.cast(dx, "float32")), want_dx, np_dtype)
    # float32 math rounded once: within one unit of the float64 value (a second rounding of
    # the float32 result to the dtype can land one unit away).
    assert y_err.max() <= 1.0, y_err.max()
    assert dx_err.max() <= 1.0, dx_err.max()


def test_gelu_beats_keras_own_bfloat16_gelu_in_accuracy():
    x = keras.ops.convert_to_tensor(X.astype(ml_dtypes.bfloat16))
    want, _ = _reference(X.astype(ml_dtypes.bfloat16).astype(np.float64), False)

    def ulps(y):
        return _ulps(keras.ops.convert_to_numpy(keras.ops.cast(y, "float32")), want, BF16)

    ours, stock = ulps(gelu(x)), ulps(keras.activations.gelu(x))
    assert ours.mean() < 0.6 * stock.mean()  # rounded once vs after every step
    assert ours.max() <= 1.0 < stock.max()


def _ffn_loss(activation):
    """A bfloat16 FFN (matmul, activation, matmul) summed to a float32 scalar."""
    import jax.numpy as jnp

    def loss(x, w_in, w_out):
        return jnp.sum((activation(x @ w_in) @ w_out).astype(jnp.float32))

    return loss


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX autodiff and XLA")
def test_jax_gelu_keeps_only_its_input_for_the_backward_pass(capsys):
    """Keras' GELU keeps three tensors of the input's size for its gradient; ours keeps the
    input alone, and XLA does not trade it for a float32 copy (it would without the
    optimization barrier: 11.1 against 7.0 units of temporaries on this FFN)."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import print_saved_residuals

    h = jnp.ones((8, 16), jnp.bfloat16)
    print_saved_residuals(gelu, h)
    ours = capsys.readouterr().out.strip().splitlines()
    print_saved_residuals(keras.activations.gelu, h)
    stock = capsys.readouterr().out.strip().splitlines()
    assert ours == ["bf16[8,16] from the argument x"], ours
    assert len([line for line in stock if line.startswith("bf16[8,16]")]) == 3, stock

    n, d, f = 4096, 256, 1024
    args = [
        jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((n, d), (d, f), (f, d))
    ]

    def temporaries(activation):
        step = jax.jit(jax.grad(_ffn_loss(activation), argnums=(0, 1, 2)))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes / (n * f * 2)

    assert temporaries(gelu) <= 1.05 * temporaries(keras.activations.gelu)


def _xla_functions(graph) -> list:
    """Names of the functions in a TF graph's library that must be compiled by XLA."""
    return [
        f.signature.name
        for f in graph.as_graph_def().library.function
        if f.attr["_XlaMustCompile"].b
    ]


@pytest.mark.tf_only
@pytest.mark.parametrize(
    "jit_compile, shape, kernel",
    [
        (False, [None, 3, 4], True),  # an unknown batch axis (`fit`): the kernel
        (True, [None, 3, 4], False),  # the whole function is XLA: Keras' GELU inside it
        (False, [None, None, 4], False),  # an unknown inner axis: Keras' ops, no recompiles
    ],
)
def test_gelu_in_graphs_with_unknown_shapes_and_under_xla(jit_compile, shape, kernel):
    """Right values everywhere; the XLA kernel only where the inner axes are known (an
    unknown sequence axis would compile it again for every length) and not inside XLA."""
    import tensorflow as tf

    x = tf.constant(np.linspace(-4, 4, 24).reshape(2, 3, 4), tf.bfloat16)

    @tf.function(jit_compile=jit_compile, input_signature=[tf.TensorSpec(shape, tf.bfloat16)])
    def value_and_grad(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = gelu(x)
            total = tf.reduce_sum(tf.cast(y, tf.float32))
        return y, tape.gradient(total, x)

    y, dx = value_and_grad(x)
    want_y, want_dx = _reference(x.numpy().astype(np.float64), False)
    np.testing.assert_allclose(tf.cast(y, tf.float32).numpy(), want_y, rtol=8e-3, atol=1e-3)
    np.testing.assert_allclose(tf.cast(dx, tf.float32).numpy(), want_dx, rtol=8e-3, atol=1e-3)
    graph = value_and_grad.get_concrete_function().graph
    nested = [f for f in _xla_functions(graph) if "value_and_grad" not in f]
    assert len(nested) == (2 if kernel else 0)  # forward and backward clusters


@pytest.mark.tf_only
@pytest.mark.parametrize(
    "shape, expected",
    [
        ((64, 256), True),  # 16384 values = MIN_ELEMENTS
        ((63, 256), False),  # fewer: TF's kernels are as fast
        ((None, 256), True),  # unknown batch axis: few distinct values, compiled once each
        ((None, 4), True),
        ((8, None, 256), False),  # unknown inner axis: a compile per sequence length
        ((None, None, 256), False),
        ((), False),
    ],
)
def test_worth_a_cluster(shape, expected):
    """Sizes and known axes decide for low-precision tensors; float32 never takes a kernel."""
    import tensorflow as tf

    from keras_mp.tf.activations import MIN_ELEMENTS
    from keras_mp.tf.xla import worth_a_cluster

    spec = tf.TensorSpec(shape, tf.bfloat16)
    assert worth_a_cluster(spec, MIN_ELEMENTS) is expected
    assert worth_a_cluster(tf.TensorSpec(shape, tf.float16), MIN_ELEMENTS) is expected
    assert worth_a_cluster(tf.TensorSpec(shape, tf.float32), MIN_ELEMENTS) is False
    assert worth_a_cluster(tf.TensorSpec(shape, tf.float32), MIN_ELEMENTS, "bfloat16") is expected
    inside_xla = tf.function(lambda: worth_a_cluster(spec, MIN_ELEMENTS), jit_compile=True)
    assert inside_xla.python_function() is expected  # eager: not compiling
    seen = []
    tf.function(lambda: seen.append(worth_a_cluster(spec, MIN_ELEMENTS)), jit_compile=True)()
    assert seen == [False]  # traced for XLA: never a nested cluster


def test_gelu_float32_is_keras_gelu_exactly():
    x = keras.ops.convert_to_tensor(X.astype("float32"))
    for approximate in (False, True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(gelu(x, approximate)),
            keras.ops.convert_to_numpy(keras.activations.gelu(x, approximate)),
        )


def _ffn_model(seq=6, features=8, width=16):
    inputs = keras.Input((seq, features))
    h = keras.layers.Dense(width, activation="gelu", name="ffn_in")(inputs)
    h = keras.layers.Activation("gelu", name="act")(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.Dense(8, activation="relu", name="ffn_out")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


@pytest.mark.tf_only
def test_gelu_takes_keras_gelu_below_the_tf_kernel_size():
    x = keras.ops.cast(keras.ops.convert_to_tensor(X[:4096].astype("float32")), "bfloat16")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(gelu(x), "float32")),
        keras.ops.convert_to_numpy(keras.ops.cast(keras.activations.gelu(x), "float32")),
    )


def test_convert_gives_gelu_layers_keras_mp_gelu_and_same_outputs():
    model = _ffn_model()
    x = np.random.default_rng(0).standard_normal((4, 6, 8)).astype("float32")
    dtype = "bfloat16" if keras.backend.backend() == "jax" else "float16"
    mixed = kmp.convert(model, f"mixed_{dtype}")
    assert mixed.get_layer("ffn_in").activation is gelu
    assert mixed.get_layer("act").activation is gelu
    assert mixed.get_layer("ffn_out").activation is keras.activations.relu
    assert model.get_layer("ffn_in").activation is keras.activations.gelu  # source untouched
    assert kmp.convert(model, "float32").get_layer("ffn_in").activation is keras.activations.gelu
    want = model.predict(x, verbose=0)
    got = keras.ops.convert_to_numpy(keras.ops.cast(mixed(x), "float32"))
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)


def test_converted_gelu_round_trips_through_keras_files(tmp_path):
    mixed = kmp.convert(_ffn_model(), "mixed_bfloat16")
    path = str(tmp_path / "m.keras")
    mixed.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("ffn_in").activation is gelu
    x = np.random.default_rng(1).standard_normal((2, 6, 8)).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(keras.ops.cast(loaded(x), "float32")),
        keras.ops.convert_to_numpy(keras.ops.cast(mixed(x), "float32")),
    )


@pytest.mark.tf_only
def test_converted_bfloat16_gelu_and_layer_norm_model_trains_and_exports(tmp_path):
    import tensorflow as tf

    # Batches of 16 x 32 x 512 values: both TF kernels take them (MIN_ELEMENTS).
    mixed = kmp.convert(_ffn_model(seq=32, features=64, width=512), "mixed_bfloat16")
    assert type(mixed.get_layer("ln")) is kmp.layers.LayerNormalization
    assert mixed.get_layer("ln")._uses_tf_kernel(tf.zeros((16, 32, 512), "bfloat16"))
    mixed.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 32, 64)).astype("float32")
    y = rng.standard_normal((64, 32, 3)).astype("float32") * 0.1
    history = mixed.fit(x, y, epochs=8, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    kmp.export_saved_model(mixed, str(tmp_path / "sm"))
    served = tf.saved_model.load(str(tmp_path / "sm")).signatures["serving_default"]
    (out,) = served(tf.constant(x[:4])).values()
    np.testing.assert_allclose(
        out.numpy(), keras.ops.convert_to_numpy(mixed(x[:4])).astype("float32"), atol=1e-2
    )


def test_erfc_fallback_for_keras_without_ops_erfc():
    # Keras 3.12 (the oldest TensorFlow 2.21 allows) has no `ops.erfc`: the fallback keeps
    # float32's relative precision over the whole range, the far tail included.
    from keras_mp.numerics.gelu_math import _erfc_rational

    z = np.concatenate([np.linspace(-6, 6, 241), [-9.0, 7.5, 9.0]]).astype("float32")
    got = keras.ops.convert_to_numpy(_erfc_rational(keras.ops.convert_to_tensor(z)))
    want = np.array([math.erfc(float(v)) for v in z])
    np.testing.assert_allclose(got, want, rtol=5e-7, atol=0)
    assert got[-1] > 0  # erfc(9) = 4.1e-37, which 1 - erf(9) rounds to 0


def test_backend_neutral_gelu_does_not_import_the_tensorflow_module_back():
    import ast
    import inspect

    import keras_mp.tf.activations as tf_activations

    tree = ast.parse(inspect.getsource(tf_activations))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "keras_mp.activations" not in imported
    assert "keras_mp.numerics.gelu_math" in imported
