"""Tests for keras_mp.policies: Policy, the FP32 keep-list, set_global_policy and convert."""

import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp import policies

LOW = ("mixed_float16", "mixed_bfloat16", "float16", "bfloat16")


def _policy(name, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pure float16/bfloat16 warn by design
        return policies.Policy(name, **kwargs)


def _mlp(name="mlp"):
    inputs = keras.Input((6,))
    x = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Dense(8, name="head_proj")(x)
    x = keras.layers.LayerNormalization(name="ln")(x)
    x = keras.layers.Dense(4, name="logits")(x)
    outputs = keras.layers.Softmax(name="probs")(x)
    return keras.Model(inputs, outputs, name=name)


def _weights_equal(a, b):
    return len(a.weights) == len(b.weights) and all(
        np.array_equal(keras.ops.convert_to_numpy(x.value), keras.ops.convert_to_numpy(y.value))
        for x, y in zip(a.weights, b.weights, strict=True)
    )


# --- Policy -------------------------------------------------------------------------------


def test_policy_names_dtypes_and_base():
    table = {
        "float32": ("float32", "float32"),
        "mixed_float16": ("float16", "float32"),
        "mixed_bfloat16": ("bfloat16", "float32"),
        "float16": ("float16", "float16"),
        "bfloat16": ("bfloat16", "bfloat16"),
    }
    assert policies.VALID_NAMES == tuple(table) + ("float8", "lean_bfloat16")
    for name, (compute, variable) in table.items():
        policy = _policy(name)
        assert isinstance(policy, keras.DTypePolicy)
        assert (policy.compute_dtype, policy.variable_dtype) == (compute, variable)
        assert type(policy.base) is keras.DTypePolicy and policy.base.name == name
        assert policy.has_master_weights == (variable == "float32")
        assert policy.keep_fp32 == kmp.DEFAULT_KEEP_FP32


def test_pure_policies_warn_about_master_weights():
    for name in ("float16", "bfloat16"):
        with pytest.warns(UserWarning, match="no FP32 master weights"):
            policies.Policy(name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            policies.Policy("mixed_" + name)  # no warning for the mixed policy


def test_unknown_policy_name_lists_valid_names():
    for bad in ("mixed_float32", "fp16", "int8", ""):
        with pytest.raises(ValueError, match="Valid names") as info:
            policies.Policy(bad)
        for name in policies.VALID_NAMES:
            assert repr(name) in str(info.value)


def test_float8_policy_converts_dense_layers_to_fp8_except_the_keep_list():
    from keras_mp import float8

    recipe = float8.Float8Recipe(margin=1, amax_history_len=16)
    policy = policies.Policy("float8", float8_recipe=recipe)
    assert (policy.compute_dtype, policy.variable_dtype) == ("bfloat16", "float32")
    assert policy.base.name == "mixed_bfloat16"
    assert policies.Policy.from_config(policy.get_config()) == policy
    with pytest.raises(ValueError, match="float8_recipe"):
        policies.Policy("mixed_bfloat16", float8_recipe=recipe)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu", name="hidden")(inputs)
    out = keras.layers.Dense(4, name="logits")(h)
    model = keras.Model(inputs, out)
    converted = kmp.convert(model, policy)
    assert [layer.path for layer in float8.float8_layers(converted)] == ["hidden"]
    assert converted.get_layer("logits").compute_dtype == "bfloat16"  # output: bf16, not FP8
    assert converted.get_layer("hidden").compute_dtype == "bfloat16"
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    ref = keras.ops.convert_to_numpy(model(x))
    got = keras.ops.convert_to_numpy(keras.ops.cast(converted(x), "float32"))
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) < 0.1  # FP8 + bf16 rounding


def test_bad_keep_list_entry_lists_valid_entries():
    for bad in (3, None, keras.layers.Dense(2), dict, ""):
        with pytest.raises(ValueError, match="Invalid keep_fp32 entry") as info:
            policies.Policy("mixed_bfloat16", keep_fp32=["softmax", bad])
        assert "['attention', 'normalization', 'output', 'router', 'softmax']" in str(info.value)


def test_keep_list_must_be_a_collection():
    with pytest.raises(ValueError, match="keep_fp32 must be a list/tuple"):
        policies.Policy("mixed_bfloat16", keep_fp32="softmax")


def test_for_layer_pins_keep_list_layers_only_under_low_precision():
    policy = _policy("mixed_bfloat16")
    pinned = [
        keras.layers.Softmax(),
        keras.layers.Activation("log_softmax"),
        keras.layers.Dense(3, activation="softmax"),
        keras.layers.UnitNormalization(),
        keras.layers.Attention(),
    ]
    # Keras' own BN/LN/GN/RMSNorm compute their statistics in float32 themselves: they stay
    # in the compute dtype (no extra casts), under pure policies too (weights low as all).
    native = [
        keras.layers.BatchNormalization(),
        keras.layers.LayerNormalization(),
        keras.layers.GroupNormalization(groups=2),
        keras.layers.RMSNormalization(),
    ]
    free = [keras.layers.Dense(3), keras.layers.Conv2D(2, 3), keras.layers.Activation("relu")]
    assert [policy.for_layer(x).name for x in pinned] == ["float32"] * len(pinned)
    assert [policy.for_layer(x).name for x in free + native] == ["mixed_bfloat16"] * 7
    pure = _policy("bfloat16")
    assert [pure.for_layer(x).name for x in native] == ["bfloat16"] * len(native)
    # The "output" token needs the model's output layers. A logits projection (linear
    # activation) keeps its matmul low under mixed policies (the losses take the log-softmax in
    # FP32); an output layer doing more, or any output layer under a pure policy, is pinned.
    logits = [keras.layers.Dense(3), keras.layers.EinsumDense("ab,bc->ac", 3),
              keras.layers.Conv2D(2, 1)]
    assert [policy.for_layer(x, output_layers=[x]).name for x in logits] == ["mixed_bfloat16"] * 3
    assert [pure.for_layer(x, output_layers=[x]).name for x in logits] == ["float32"] * 3
    for other in (keras.layers.Dense(3, activation="sigmoid"), keras.layers.Activation("tanh")):
        assert policy.for_layer(other, output_layers=[other]).name == "float32", other
        assert policy.for_layer(other).name == "mixed_bfloat16"  # not an output: not pinned
    # Outputs that do not squash are exact enough low (features, a relu, an add, a lookup);
    # under a pure policy those with weights are pinned.
    for plain in (keras.layers.Dense(3, "relu"), keras.layers.Embedding(4, 2),
                  keras.layers.Add(), keras.layers.Activation("relu")):
        assert policy.for_layer(plain, output_layers=[plain]).name == "mixed_bfloat16", plain
    add = keras.layers.Add()
    assert pure.for_layer(add, output_layers=[add]).name == "bfloat16"
    # Under float32 there is nothing to pin.
    assert _policy("float32").for_layer(keras.layers.Softmax()).name == "float32"
    assert policy.keep_entry(keras.layers.LayerNormalization()) == "normalization"


def test_keep_list_extension_and_removal():
    head = keras.layers.Dense(3, name="cls_head")
    norm = keras.layers.LayerNormalization()
    extended = _policy("mixed_float16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("*head*",))
    assert extended.for_layer(head).name == "float32"
    assert _policy("mixed_float16").for_layer(head).name == "mixed_float16"
    by_class = _policy("mixed_float16", keep_fp32=[keras.layers.Dense])
    assert by_class.for_layer(head).name == "float32"
    assert _policy("mixed_float16").for_layer(norm).name == "mixed_float16"  # FP32 stats inside
    whole = _policy("mixed_float16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("LayerNormalization",))
    assert whole.for_layer(norm).name == "float32"
    removed = [e for e in kmp.DEFAULT_KEEP_FP32 if e != "output"]
    assert _policy("mixed_float16", keep_fp32=removed).for_layer(head, [head]).name == (
        "mixed_float16"
    )


def test_dtype_policy_map_over_layer_paths():
    model = _mlp()
    policy_map = _policy("mixed_bfloat16").dtype_policy_map(model)
    assert isinstance(policy_map, keras.dtype_policies.DTypePolicyMap)
    assert policy_map.default_policy.name == "mixed_bfloat16"
    # Softmax has no path; BN/LN keep FP32 stats inside; the logits Dense runs low.
    assert sorted(policy_map) == []
    pinned = _policy("mixed_bfloat16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("logits",))
    pinned_map = pinned.dtype_policy_map(model)
    assert sorted(pinned_map) == ["logits"]
    assert pinned_map["logits"].name == "float32"
    assert pinned_map["hidden"].name == policy_map["logits"].name == "mixed_bfloat16"


def test_policy_config_round_trip_and_serialization():
    policy = _policy("mixed_float16", keep_fp32=[keras.layers.Dense, "*head*", "output"])
    config = policy.get_config()
    assert config == {"name": "mixed_float16", "keep_fp32": ["Dense", "*head*", "output"]}
    restored = policies.Policy.from_config(config)
    assert restored == policies.Policy("mixed_float16", keep_fp32=["Dense", "*head*", "output"])
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(policy))
    assert again == restored and restored.for_layer(keras.layers.Dense(2)).name == "float32"
    # A Policy works as a layer's dtype and survives the layer's config.
    layer = keras.layers.Dense(2, dtype=policies.Policy("mixed_bfloat16"))
    clone = keras.layers.Dense.from_config(layer.get_config())
    assert clone.compute_dtype == "bfloat16" and clone.variable_dtype == "float32"


def test_set_global_policy_sets_keras_policy_and_is_remembered():
    policy = _policy("mixed_bfloat16", keep_fp32=("softmax",))
    kmp.set_global_policy(policy)
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert type(keras.config.dtype_policy()) is keras.DTypePolicy
    assert kmp.global_policy() is policy
    dense = keras.layers.Dense(2)
    assert (dense.compute_dtype, dense.variable_dtype) == ("bfloat16", "float32")
    kmp.set_global_policy("float32")
    assert kmp.global_policy() == policies.Policy("float32")
    keras.config.set_dtype_policy("mixed_float16")  # changed behind our back
    assert kmp.global_policy() == policies.Policy("mixed_float16")
    with pytest.raises(ValueError, match="Valid names"):
        kmp.set_global_policy("half")


# --- convert ------------------------------------------------------------------------------


def _check_converted(model, converted, policy_name, pinned):
    """Every layer runs as the keep-list says; the original is untouched."""
    low = _policy(policy_name).compute_dtype
    for layer in converted._flatten_layers(include_self=False):
        if isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue
        expected = "float32" if layer.name in pinned else low
        assert layer.compute_dtype == expected, layer.name
        own = layer._trainable_variables + layer._non_trainable_variables
        for variable in own:
            assert variable.dtype == ("float32" if layer.name in pinned else layer.variable_dtype)
    assert all(x.dtype_policy.name == "float32" for x in model._flatten_layers())


@pytest.mark.parametrize("policy_name", ["mixed_bfloat16", "bfloat16"])
def test_convert_functional_pins_keep_list_and_copies_weights(policy_name):
    model = _mlp()
    before = [keras.ops.convert_to_numpy(w.value).copy() for w in model.weights]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted = kmp.convert(model, policy_name)
    assert converted is not model
    # BN/LN compute FP32 statistics themselves: never pinned. The logits Dense runs low under
    # the mixed policy (FP32 master weights; the pinned Softmax reads its output in FP32).
    low = {"logits"} if policy_name == "bfloat16" else set()
    _check_converted(model, converted, policy_name, pinned={"probs"} | low)
    after = [keras.ops.convert_to_numpy(w.value) for w in model.weights]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    if policy_name == "mixed_bfloat16":
        assert _weights_equal(model, converted)  # FP32 master weights, bit-identical
    x = np.random.default_rng(0).normal(size=(32, 6)).astype("float32")
    y_ref = keras.ops.convert_to_numpy(model(x))
    y = keras.ops.convert_to_numpy(converted(x))
    assert y.dtype == np.float32
    # bfloat16 keeps 8 mantissa bits: probabilities agree to a few 1e-3.
    np.testing.assert_allclose(y, y_ref, atol=2e-2)


def test_convert_sequential_nested_and_output_activation():
    inner = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, name="inner_dense"),
            keras.layers.LayerNormalization(name="inner_ln"),
        ],
        name="inner",
    )
    model = keras.Sequential(
        [
            keras.Input((5,)),
            inner,
            keras.layers.Dense(3, name="out"),
            keras.layers.Activation("softmax", name="act"),
        ],
        name="outer",
    )
    converted = kmp.convert(model, "mixed_bfloat16")
    assert isinstance(converted, keras.Sequential)
    # "out" feeds the output Activation: it is an output layer, but a plain logits projection,
    # so it runs bfloat16 and only the softmax Activation is pinned.
    _check_converted(model, converted, "mixed_bfloat16", pinned={"act"})
    assert _weights_equal(model, converted)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class _Block(keras.layers.Layer):
    """A custom layer whose sublayers are created in __init__ without dtype=."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.proj = keras.layers.Dense(units, name="proj")
        self.norm = keras.layers.LayerNormalization(name="norm")

    def call(self, x):
        return self.norm(x + self.proj(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class _Classifier(keras.Model):
    def __init__(self, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.classes = classes
        self.block = _Block(8, name="block")
        self.head = keras.layers.Dense(classes, name="head")

    def call(self, x):
        return self.head(self.block(x))

    def get_config(self):
        return {**super().get_config(), "classes": self.classes}


def _block_model(kind):
    if kind == "functional":
        inputs = keras.Input((8,))
        x = _Block(name="block")(inputs)
        x = _Block(name="block2")(x)
        return keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    model = _Classifier()
    model(np.zeros((1, 8), "float32"))
    return model


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_convert_pure_policy_pins_with_fp32_variables(kind):
    """Under a pure policy the model is rebuilt with low variables; pinned layers get FP32
    variables, and a pin inside a block (`x + self.proj(x)`) is lifted to the block."""
    model = _block_model(kind)
    policy = _policy("float16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("*block/proj",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        converted = kmp.convert(model, policy)
    assert type(converted) is type(model)
    pins = {p.path: p for p in converted.precision_plan.pins}
    block_path = converted.get_layer("block").path
    assert set(pins) == {block_path, converted.get_layer("head").path}
    assert pins[block_path].note.startswith(f"lifted from '{block_path}/proj'")
    for sub in (converted.get_layer("block").proj, converted.get_layer("block").norm):
        assert (sub.compute_dtype, sub.variable_dtype) == ("float32", "float32")
        assert all(v.dtype == "float32" for v in sub.weights)
    head = converted.get_layer("head")
    assert (head.compute_dtype, head.kernel.dtype) == ("float32", "float32")  # output layer
    if kind == "functional":
        proj2 = converted.get_layer("block2").proj
        assert (proj2.compute_dtype, proj2.kernel.dtype) == ("float16", "float16")
        assert _weights_equal(model, converted) is False  # float16 copies are rounded ...
    np.testing.assert_array_equal(  # ... FP32-pinned layers are carried exactly
        keras.ops.convert_to_numpy(converted.get_layer("block").proj.kernel.value),
        keras.ops.convert_to_numpy(model.get_layer("block").proj.kernel.value),
    )
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(converted(x)), keras.ops.convert_to_numpy(model(x)),
        atol=2e-2,
    )


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_convert_mixed_pin_inside_a_block_pins_the_block(kind):
    model = _block_model(kind)
    policy = _policy("mixed_float16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("*proj*",))
    converted = kmp.convert(model, policy)
    block = converted.get_layer("block")
    assert {x.compute_dtype for x in block._flatten_layers()} == {"float32"}
    assert "whole block runs in float32" in "".join(converted.precision_plan.notes)
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    y = converted(x)  # TF would reject float16 + float32 inside the block
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(keras.ops.cast(y, "float32")),
        keras.ops.convert_to_numpy(model(x)), atol=1e-2,
    )
    assert _weights_equal(model, converted)


def test_convert_swaps_attention_and_softmax_for_keras_mp_layers():
    layers = pytest.importorskip("keras_mp.layers")
    inputs = keras.Input((6, 8))
    x = keras.layers.MultiHeadAttention(2, 4, name="mha")(inputs, inputs)
    scores = keras.layers.Softmax(name="sm")(keras.layers.Dense(6, name="d")(x))
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling1D(name="pool")(scores))
    converted = kmp.convert(model, "mixed_bfloat16")
    assert type(converted.get_layer("mha")) is layers.MultiHeadAttention
    assert type(converted.get_layer("sm")) is layers.Softmax
    sublayers = converted.get_layer("mha")._flatten_layers()
    assert len(sublayers) == 7  # itself, query/key/value/output projections, softmax, dropout
    assert {x.compute_dtype for x in sublayers} == {"bfloat16"}  # softmax: FP32 inside
    assert _weights_equal(model, converted)
    # Without the "attention" entry the stock layer stays, its softmax pinned to float32.
    keep = [e for e in kmp.DEFAULT_KEEP_FP32 if e != "attention"]
    stock = kmp.convert(model, policies.Policy("mixed_bfloat16", keep_fp32=keep))
    mha = stock.get_layer("mha")
    assert type(mha) is keras.layers.MultiHeadAttention
    assert mha._softmax.compute_dtype == "float32" and mha.compute_dtype == "bfloat16"
    x = np.random.default_rng(1).normal(size=(4, 6, 8)).astype("float32")
    ref = keras.ops.convert_to_numpy(model(x))
    for m in (converted, stock):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(m(x)), ref, atol=2e-2)


def test_convert_swaps_layer_normalization_under_the_normalization_entry():
    layers = pytest.importorskip("keras_mp.layers")
    inputs = keras.Input((6, 8))
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="ln")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
    model.get_layer("ln").gamma.assign(np.linspace(0.5, 1.5, 8).astype("float32"))
    converted = kmp.convert(model, "mixed_bfloat16")
    ln = converted.get_layer("ln")
    assert type(ln) is layers.LayerNormalization and ln.compute_dtype == "bfloat16"
    source = model.get_layer("ln").get_config()
    assert {k: v for k, v in ln.get_config().items() if k != "dtype"} == {
        k: v for k, v in source.items() if k != "dtype"
    }
    assert _weights_equal(model, converted)
    keep = [e for e in kmp.DEFAULT_KEEP_FP32 if e != "normalization"]
    plain = kmp.convert(model, policies.Policy("mixed_bfloat16", keep_fp32=keep))
    assert type(plain.get_layer("ln")) is keras.layers.LayerNormalization
    assert type(kmp.convert(model, "float32").get_layer("ln")) is keras.layers.LayerNormalization
    x = np.random.default_rng(1).normal(size=(4, 6, 8)).astype("float32")
    ref = keras.ops.convert_to_numpy(model(x))
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(keras.ops.cast(converted(x), "float32")), ref, atol=3e-2
    )


def test_convert_rejects_unbuilt_and_unclonable_models():
    with pytest.raises(ValueError, match="not built"):
        kmp.convert(keras.Sequential([keras.layers.Dense(2)]), "mixed_bfloat16")

    class NoConfig(keras.Model):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer
            self.head = keras.layers.Dense(2)

        def call(self, x):
            return self.head(self.layer(x))

    model = NoConfig(keras.layers.Dense(4))
    model(np.zeros((1, 3), "float32"))
    # A model without a usable get_config() converts: it is copied, not rebuilt.
    for name in ("mixed_bfloat16", "bfloat16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            converted = kmp.convert(model, name)
        assert converted.layer.compute_dtype == "bfloat16" and converted.layer is not model.layer
        assert converted.layer.kernel.dtype == _policy(name).variable_dtype
    assert model.layer.kernel.dtype == "float32"
    with pytest.raises(ValueError, match="Valid names"):
        kmp.convert(_mlp(), "fp16")


def test_convert_warns_about_keep_entries_matching_nothing():
    policy = _policy("mixed_bfloat16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("*encoder*",))
    with pytest.warns(UserWarning, match=r"\['\*encoder\*'\] match no layer"):
        kmp.convert(_mlp(), policy)


@pytest.mark.parametrize(
    "policy_name", ["mixed_bfloat16", pytest.param("mixed_float16", marks=pytest.mark.tf_only)]
)
def test_converted_model_trains_a_few_steps(policy_name):
    model = _mlp()
    before = [keras.ops.convert_to_numpy(w.value).copy() for w in model.weights]
    converted = kmp.convert(model, policy_name)
    optimizer = keras.optimizers.Adam(1e-2)
    if policy_name == "mixed_float16":
        optimizer = kmp.LossScaleOptimizer(optimizer)
    converted.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        jit_compile=False,  # tiny model: XLA compile would cost more than float16 on CPU
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")
    history = converted.fit(x, y, batch_size=16, epochs=4, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0]
    assert converted.get_layer("hidden").kernel.dtype == "float32"  # master weights stay FP32
    assert not _weights_equal(model, converted)  # it trained; the original did not:
    for snapshot, w in zip(before, model.weights, strict=True):  # (no buffer shared on JAX)
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(w.value), snapshot)


def test_converted_model_saves_and_loads_without_keras_mp_policy(tmp_path):
    converted = kmp.convert(_mlp(), "mixed_bfloat16")
    path = str(tmp_path / "mixed.keras")
    converted.save(path)
    loaded = keras.saving.load_model(path)
    dtypes = {x.name: x.compute_dtype for x in loaded.layers[1:]}  # after the InputLayer
    assert dtypes == {x.name: x.compute_dtype for x in converted.layers[1:]}
    assert dtypes["probs"] == "float32" and dtypes["hidden"] == "bfloat16"
    assert _weights_equal(converted, loaded)


def test_subclass_that_does_not_pass_its_dtype_on_reloads_as_converted(tmp_path):
    """`_Classifier` makes its layers without `dtype=` (as keras_hub's SmolLM3 does): loaded,
    they get the global float32; `kmp.saving.load_model` puts the plan back, and their
    float32 is not mistaken for pins saved in the file."""
    converted = kmp.convert(_block_model("subclassed"), "mixed_bfloat16")
    path = str(tmp_path / "sub.keras")
    converted.save(path)
    # With keras_mp imported, Keras' own load puts the saved plan back too (the file holds
    # it since the 52 fixes); before, it gave the global float32 that kmp had to undo.
    plain = keras.saving.load_model(path)
    assert plain.get_layer("block").proj.compute_dtype == "bfloat16"
    loaded = kmp.saving.load_model(path)

    def dtypes(model):
        return [(x.name, x.compute_dtype) for x in model._flatten_layers(include_self=False)]

    assert dtypes(loaded) == dtypes(converted)
    assert loaded.get_layer("block").proj.compute_dtype == "bfloat16"
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(converted(x))
    )


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class _Forgetful(keras.Model):
    """Its config drops its dtype (keras_hub's VGG backbone does the same), and its head is a
    `keras.Sequential` made in the constructor (as keras_hub's image classifiers make it)."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu", name="hidden")
        self.head = keras.Sequential([keras.layers.Dense(units, name="fc1"),
                                      keras.layers.Dense(3, name="logits")], name="head")

    def call(self, x):
        return self.head(self.hidden(x))

    def get_config(self):
        return {"units": self.units}  # no super().get_config(): no name, no dtype


def test_model_whose_config_drops_its_dtype_reloads_as_converted(tmp_path):
    model = _Forgetful()
    model(np.zeros((1, 8), "float32"))
    converted = kmp.convert(model, "mixed_bfloat16")
    path = str(tmp_path / "forgetful.keras")
    converted.save(path)
    loaded = kmp.saving.load_model(path)
    assert isinstance(loaded.dtype_policy, keras.dtype_policies.DTypePolicyMap)
    for name in ("hidden", "head/fc1", "head/logits"):
        want = converted.get_layer(name.split("/")[0])
        got = loaded.get_layer(name.split("/")[0])
        if "/" in name:
            want, got = (m.get_layer(name.split("/")[1]) for m in (want, got))
        assert got.compute_dtype == want.compute_dtype == "bfloat16", name
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x)), keras.ops.convert_to_numpy(converted(x))
    )
    # The original's config is as it was; a copy of the converted model saves its own map.
    assert "dtype" not in model.get_config()
    assert "dtype" in kmp.convert(converted, "mixed_bfloat16").get_config()


@pytest.mark.parametrize("policy_name", ["mixed_float16", "mixed_bfloat16"])
def test_unpinned_normalization_layers_keep_fp32_statistics(policy_name):
    """Keras' BN/LN up-cast for the statistics: with inputs near 300 the squares (9e4) are
    past FP16's 65504, yet the low-precision layers match the FP32 ones to output rounding."""
    rng = np.random.default_rng(0)
    x = (300.0 + 40.0 * rng.normal(size=(64, 16))).astype("float32")
    low = _policy(policy_name).compute_dtype
    eps = 2.0**-10 if low == "float16" else 2.0**-7
    for cls in (keras.layers.BatchNormalization, keras.layers.LayerNormalization):
        ref_layer, low_layer = cls(), cls(dtype=policy_name)
        ref = keras.ops.convert_to_numpy(ref_layer(x, training=True))
        got = keras.ops.convert_to_numpy(low_layer(x, training=True)).astype("float32")
        assert low_layer.compute_dtype == low
        assert np.isfinite(got).all()
        # Input rounding to the low dtype (relative eps of 300 is ~0.3 in FP16 units of the
        # std 40) plus output rounding; an FP16 variance would be inf/NaN instead.
        np.testing.assert_allclose(got, ref, atol=300 * eps / 40 * 4 + 4 * eps)


@pytest.mark.tf_only
@pytest.mark.slow  # CI time (2026-12-06): runs with -m slow
def test_moe_router_runs_in_float32_and_keras_hub_mixtral_trains():
    """keras_hub's Mixtral fails to train under stock Keras mixed precision on TensorFlow:
    its load-balancing loss multiplies low-precision router probabilities by a float32
    mask. The "router" entry runs the router in float32 (not its experts)."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=32, num_experts=4, top_k=2, sliding_window=4,
    )
    ids = np.random.default_rng(0).integers(0, 64, (2, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    y = np.zeros((2, 8, 16), "float32")
    for policy in ("mixed_bfloat16", "mixed_float16"):
        converted = kmp.convert(backbone, policy)
        pins = [p.path for p in converted.precision_plan.pins]
        assert "transformer_layer_0/mixtral_sparse_moe_block/sparse_feedforward_gate_dense" in pins
        block = converted.get_layer("transformer_layer_0")._sparse_moe_block
        assert block.compute_dtype == kmp.Policy(policy).compute_dtype  # experts stay low
        converted.compile(optimizer="adam", loss="mse", jit_compile=True)
        loss = converted.train_on_batch(x, y, return_dict=True)["loss"]
        assert np.isfinite(loss)
    # Without the entry, the Keras way fails as stock Keras does.
    keep = [e for e in kmp.DEFAULT_KEEP_FP32 if e != "router"]
    plain = kmp.convert(backbone, policies.Policy("mixed_bfloat16", keep_fp32=keep))
    plain.compile(optimizer="adam", loss="mse", jit_compile=True)
    with pytest.raises(Exception, match="Mul"):
        plain.train_on_batch(x, y)
