"""export_saved_model: float32 serving signatures for mixed models, FP32 clones, serving
from a process that only has TensorFlow."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_mp as kmp
from keras_mp.tf import float32_clone

RNG = np.random.default_rng(0)
TOKENS = RNG.integers(0, 20, (5, 6)).astype("int32")
FEATURES = RNG.normal(size=(5, 6, 8)).astype("float32")


def _mixed_model():
    """An FP32 model converted to mixed_float16 with keras_mp layers in it.

    Inputs: int32 tokens and float features; the output layer is left in float16 (no
    "output" keep-list entry); the converted model casts its output to float32.
    """
    from keras_mp import layers as kl

    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    features = keras.Input((6, 8), name="features")
    x = keras.layers.Add()([keras.layers.Embedding(20, 8)(tokens), features])
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(x, x)  # -> kmp's
    x = kl.Float32(keras.layers.LayerNormalization())(x)
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(16, activation="relu")(x))
    outputs = keras.layers.Dense(3)(x)
    model = keras.Model({"tokens": tokens, "features": features}, outputs)
    policy = kmp.Policy("mixed_float16", keep_fp32=("softmax", "attention", "LayerNormalization"))
    mixed = kmp.convert(model, policy)
    assert any(isinstance(layer, kl.MultiHeadAttention) for layer in mixed.layers)
    return mixed


def _inputs():
    return {"tokens": TOKENS, "features": FEATURES}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    if BACKEND != "tensorflow":
        pytest.skip("needs the TensorFlow backend")
    root = tmp_path_factory.mktemp("export")
    model = _mixed_model()
    paths = {c: str(root / c) for c in ("mixed", "float32")}
    clone = kmp.export_saved_model(model, paths["float32"], compute="float32")
    assert kmp.export_saved_model(model, paths["mixed"]) is model
    outputs = dict(
        keras_mixed=keras.ops.convert_to_numpy(model(_inputs(), training=False)),
        keras_fp32=keras.ops.convert_to_numpy(clone(_inputs(), training=False)),
    )
    return model, clone, paths, outputs


@pytest.mark.tf_only
@pytest.mark.parametrize("compute", ["mixed", "float32"])
def test_signature_takes_and_returns_float32(exported, compute):
    import tensorflow as tf

    model, _, paths, outputs = exported
    # the converted model casts its outputs to float32 (its last layer computes float16)
    assert outputs["keras_mixed"].dtype == np.float32
    served = tf.saved_model.load(paths[compute])
    signature = served.signatures["serving_default"]
    _, inputs = signature.structured_input_signature
    assert {k: (v.dtype, tuple(v.shape)) for k, v in inputs.items()} == {
        "features": (tf.float32, (None, 6, 8)),
        "tokens": (tf.int32, (None, 6)),  # integer inputs keep their dtype
    }
    assert [(v.dtype, tuple(v.shape)) for v in signature.structured_outputs.values()] == [
        (tf.float32, (None, 3))
    ]
    y = served.serve(_inputs())
    assert y.dtype == tf.float32


@pytest.mark.tf_only
def test_mixed_export_matches_the_keras_model(exported):
    import tensorflow as tf

    _, _, paths, outputs = exported
    served = tf.saved_model.load(paths["mixed"])  # keep a reference: it owns the variables
    y = served.serve(_inputs()).numpy()
    # Same float16 ops as model(x) (measured: identical); allow one float16 ulp.
    np.testing.assert_allclose(y, outputs["keras_mixed"].astype("float32"), rtol=1e-3, atol=1e-3)


@pytest.mark.tf_only
def test_float32_export_matches_the_fp32_clone(exported):
    import tensorflow as tf

    _, _, paths, outputs = exported
    served = tf.saved_model.load(paths["float32"])
    y = served.serve(_inputs()).numpy()
    np.testing.assert_allclose(y, outputs["keras_fp32"], rtol=1e-5, atol=1e-6)
    # and it really computes in float32: it differs from the float16 model by float16
    # rounding only (|diff| <= 2e-2 on outputs of size ~1).
    diff = np.abs(y - outputs["keras_mixed"].astype("float32"))
    assert 0 < diff.max() < 2e-2


@pytest.mark.tf_only
def test_float32_clone_has_the_same_weights_in_float32(exported):
    model, clone, _, _ = exported
    layers = list(clone._flatten_layers(include_self=False))
    assert {layer.compute_dtype for layer in layers} == {"float32"}
    assert [v.name for v in clone.weights] == [v.name for v in model.weights]
    for a, b in zip(clone.weights, model.weights):
        assert a.dtype == "float32"
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(a.value), keras.ops.convert_to_numpy(b.value)
        )


def test_float32_clone_widens_pure_float16_weights():
    with pytest.warns(UserWarning, match="no FP32 master weights"):
        policy = kmp.Policy("float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype=policy)])
    kernel = keras.ops.convert_to_numpy(model.layers[0].kernel.value)
    assert kernel.dtype == np.float16
    clone = float32_clone(model)
    got = keras.ops.convert_to_numpy(clone.layers[0].kernel.value)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, kernel.astype("float32"))


@pytest.mark.tf_only
def test_tfsm_layer_serves_the_export(exported):
    _, _, paths, outputs = exported
    # dtype="float32": the TFSMLayer would otherwise follow the global policy.
    layer = keras.layers.TFSMLayer(paths["float32"], call_endpoint="serve", dtype="float32")
    y = keras.ops.convert_to_numpy(layer(_inputs()))
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, outputs["keras_fp32"], rtol=1e-5, atol=1e-6)


SERVE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf

    root = sys.argv[1]
    inputs = {k: tf.constant(np.load(f"{root}/{k}.npy")) for k in ("tokens", "features")}
    report = {}
    for compute in ("mixed", "float32"):
        served = tf.saved_model.load(f"{root}/{compute}")
        fn = served.signatures["serving_default"]
        y = fn(**inputs)["output_0"]
        np.save(f"{root}/served_{compute}.npy", y.numpy())
        report[compute] = y.dtype.name
    report["keras_mp_imported"] = any(m.split(".")[0] == "keras_mp" for m in sys.modules)
    print(json.dumps(report))
    """
)


@pytest.mark.tf_only
def test_fresh_process_with_only_tensorflow_serves_the_export(exported, tmp_path):
    _, _, paths, outputs = exported
    root = os.path.dirname(paths["mixed"])
    for key, value in _inputs().items():
        np.save(os.path.join(root, f"{key}.npy"), value)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", SERVE_SCRIPT, root],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"mixed": "float32", "float32": "float32", "keras_mp_imported": False}
    np.testing.assert_allclose(
        np.load(os.path.join(root, "served_float32.npy")),
        outputs["keras_fp32"],
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_allclose(
        np.load(os.path.join(root, "served_mixed.npy")),
        outputs["keras_mixed"].astype("float32"),
        rtol=1e-3,
        atol=1e-3,
    )


@pytest.mark.tf_only
def test_serving_dtype_float16(exported, tmp_path):
    import tensorflow as tf

    model, _, _, outputs = exported
    path = str(tmp_path / "fp16")
    kmp.export_saved_model(model, path, serving_dtype="float16", compute="float32")
    served = tf.saved_model.load(path)
    fn = served.signatures["serving_default"]
    _, inputs = fn.structured_input_signature
    assert inputs["features"].dtype == tf.float16 and inputs["tokens"].dtype == tf.int32
    y = fn(tokens=tf.constant(TOKENS), features=tf.constant(FEATURES, tf.float16))["output_0"]
    assert y.dtype == tf.float16
    np.testing.assert_allclose(y.numpy().astype("float32"), outputs["keras_fp32"], atol=2e-2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(serving_dtype="int8"), r"`serving_dtype`='int8'.*'float32', 'float16'"),
        (dict(compute="fp32"), r"`compute`='fp32'.*\['mixed', 'float32'\]"),
    ],
)
def test_invalid_arguments_name_the_choices(kwargs, match, tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=match):
        kmp.export_saved_model(model, str(tmp_path / "x"), **kwargs)


@pytest.mark.skipif(BACKEND == "tensorflow", reason="checks the error on other backends")
def test_other_backends_get_a_clear_error(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="needs the TensorFlow backend"):
        kmp.export_saved_model(model, str(tmp_path / "x"))


@pytest.mark.skipif(BACKEND != "jax", reason="checked in the JAX pass")
def test_importing_keras_mp_on_jax_does_not_import_tensorflow():
    code = (
        "import sys, keras_mp; keras_mp.export_saved_model; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow')[:3])"
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.tf_only
def test_explicit_input_signature_gets_the_serving_dtype(tmp_path):
    import tensorflow as tf

    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    keras.config.set_dtype_policy("float32")
    path = str(tmp_path / "explicit")
    # A float16 spec (what the model computes in) is served as float32 all the same.
    kmp.export_saved_model(model, path, input_signature=[tf.TensorSpec((None, 4), tf.float16)])
    served = tf.saved_model.load(path)
    fn = served.signatures["serving_default"]
    (spec,) = fn.structured_input_signature[1].values()
    assert (spec.dtype, tuple(spec.shape)) == (tf.float32, (None, 4))
    x = RNG.normal(size=(3, 4)).astype("float32")
    y = fn(tf.constant(x))["output_0"]
    assert y.dtype == tf.float32
    np.testing.assert_array_equal(y.numpy(), keras.ops.convert_to_numpy(model(x)).astype("float32"))


def _layer_norm_model():
    inputs = keras.Input((8,))
    h = keras.layers.LayerNormalization()(keras.layers.Dense(16)(inputs))
    return kmp.convert(keras.Model(inputs, keras.layers.Dense(2)(h)), "mixed_float16")


@pytest.mark.tf_only
def test_saved_model_of_a_converted_model_has_no_layer_norm_kernel_loops(tmp_path):
    # keras_mp's fused layer norm (XLA clusters in a loop over blocks of rows) went into the
    # SavedModel: TFLite failed on its TensorListReserve, inside keras_mp's layer.
    import tensorflow as tf

    model = _layer_norm_model()
    model.export(str(tmp_path / "served"), verbose=False)
    served = tf.saved_model.load(str(tmp_path / "served"))
    graph = served.signatures["serving_default"].graph.as_graph_def()
    ops_used = {n.op for n in graph.node}
    ops_used |= {n.op for f in graph.library.function for n in f.node_def}
    assert not ops_used & {"TensorListReserve", "XlaLaunch", "While", "StatelessWhile"}, ops_used


@pytest.mark.tf_only
def test_tflite_converts_the_float32_export(tmp_path):
    import tensorflow as tf

    model = _layer_norm_model()
    kmp.export_saved_model(model, str(tmp_path / "served"), compute="float32")
    flat = tf.lite.TFLiteConverter.from_saved_model(str(tmp_path / "served")).convert()
    interpreter = tf.lite.Interpreter(model_content=flat)
    runner = interpreter.get_signature_runner("serving_default")
    x = np.random.default_rng(0).normal(size=(1, 8)).astype("float32")
    (got,) = runner(**{runner.get_input_details().popitem()[0]: x}).values()
    want = keras.ops.convert_to_numpy(model.predict_on_batch(x))
    np.testing.assert_allclose(got, want, atol=2e-2)  # float16 matmuls vs float32
