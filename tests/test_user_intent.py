"""What users write with Keras' own spellings, kept or named (issue 52): Keras' pure
policies warn at compile, a user's float32 pins survive `convert`, a model built under
Keras' global `"mixed_float16"` converts whole (its InputLayer too)."""

import re
import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp

TF = keras.backend.backend() == "tensorflow"


def _data(n=128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x.sum(1) > 0).astype("int32")


def _mlp():
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )


def _compile_recording(model, optimizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return [str(w.message) for w in caught if "master copy" in str(w.message)]


@pytest.mark.skipif(not TF, reason="bfloat16 Adam on CPU: the TensorFlow run shows it")
def test_keras_pure_bfloat16_adam_changes_no_weight_and_compile_says_why():
    keras.mixed_precision.set_global_policy("bfloat16")
    model = _mlp()
    messages = _compile_recording(model, keras.optimizers.Adam(1e-2))
    before = [keras.ops.convert_to_numpy(keras.ops.cast(v, "float32")) for v in model.weights]
    x, y = _data()
    losses = model.fit(x, y, epochs=3, batch_size=32, verbose=0).history["loss"]
    after = [keras.ops.convert_to_numpy(keras.ops.cast(v, "float32")) for v in model.weights]
    # the silent case is real: not one weight moves, the loss is flat
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert max(losses) - min(losses) < 1e-6
    # ... and compile said so, once, with the reason and the fix
    assert len(messages) == 1, messages
    assert "beta_2=0.999 rounds to 1.0 in bfloat16" in messages[0]
    assert "'mixed_bfloat16'" in messages[0] and "'lean_bfloat16'" in messages[0]
    assert not _compile_recording(model, keras.optimizers.Adam(1e-2))  # once per model


def test_keras_pure_float16_warns_at_compile_naming_mixed_float16():
    keras.mixed_precision.set_global_policy("float16")
    messages = _compile_recording(_mlp(), keras.optimizers.SGD(1e-5))
    assert len(messages) == 1
    assert "stored in float16" in messages[0] and "Nothing scales the loss" in messages[0]
    assert "'mixed_float16'" in messages[0]
    # Glorot kernels of ~0.1-0.5 and a step of 1e-5: most updates are below half their
    # spacing (the zero biases and the smallest kernel entries move)
    share = int(re.search(r"leaves (\d+)% of them unchanged", messages[0]).group(1))
    assert 80 <= share < 100, messages[0]


def test_mixed_and_lean_policies_do_not_get_the_pure_warning():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    assert not _compile_recording(_mlp(), "adam")
    keras.mixed_precision.set_global_policy("float32")
    lean = kmp.convert(_mlp(), "lean_bfloat16", check=None)
    assert not _compile_recording(lean, "adam")


def _with_pin(name="pinned", **kwargs):
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = keras.layers.Dense(16, name=name, **kwargs)(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def test_explicit_float32_layer_under_a_float32_global_is_named_with_the_fix():
    # built under the default float32 global policy: a pin, or a helper's dtype argument?
    model = _with_pin(dtype="float32")
    with pytest.warns(UserWarning, match=r"'pinned'.*keep_fp32=\[\*kmp.DEFAULT_KEEP_FP32, "):
        mixed = kmp.convert(model, "mixed_float16", check=None)
    assert mixed.get_layer("pinned").compute_dtype == "float16"
    # the fix it names keeps it
    policy = kmp.Policy("mixed_float16", keep_fp32=[*kmp.DEFAULT_KEEP_FP32, "pinned"])
    kept = kmp.convert(model, policy, check=None)
    assert kept.get_layer("pinned").compute_dtype == "float32"
    # a model whose every layer says float32 (a helper's dtype="float32") is not named
    inputs = keras.Input((8,))
    x = keras.layers.Dense(4, dtype="float32")(inputs)
    helper = keras.Model(inputs, keras.layers.Dense(2, dtype="float32")(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kmp.plan(helper, "mixed_float16").pins == []
        kmp.convert(helper, "mixed_float16", check=None)


def test_float32_layer_made_under_a_low_global_policy_is_pinned_by_the_user():
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16, activation="relu")(inputs)
    x = keras.layers.Dense(16, name="pinned", dtype="float32")(x)
    keras.mixed_precision.set_global_policy("float32")
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    mixed = kmp.convert(model, "mixed_float16", check=None)
    assert mixed.get_layer("pinned").compute_dtype == "float32"
    reasons = [(p.path, p.reason) for p in mixed.precision_plan.pins]
    assert reasons == [
        ("pinned", "dtype 'float32' set by the user (global policy 'mixed_float16')")
    ]


def test_keras_guide_float32_head_under_global_mixed_policy_is_kept():
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((8,))
    x = keras.layers.Dense(16)(inputs)
    outputs = keras.layers.Activation("linear", dtype="float32", name="head")(x)
    keras.mixed_precision.set_global_policy("float32")
    model = keras.Model(inputs, outputs)  # the container itself in float32
    plan = kmp.plan(model, "mixed_bfloat16")
    assert [p.path for p in plan.pins] == ["head"]
    assert plan.pins[0].reason.startswith("dtype 'float32' set by the user")


def test_users_dtype_policy_map_entry_is_kept():
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    policy_map["pinned"] = keras.DTypePolicy("float32")
    model = _with_pin(dtype=policy_map)
    mixed = kmp.convert(model, "mixed_float16", check=None)
    assert mixed.get_layer("pinned").compute_dtype == "float32"
    assert "user's DTypePolicyMap" in mixed.precision_plan.pins[0].reason
    # a keras_mp map (a converted model converted again) is not "the user's"
    again = kmp.plan(mixed, "mixed_bfloat16")
    assert [p.path for p in again.pins] == ["pinned"]


@pytest.mark.parametrize("target", ["mixed_bfloat16", "float32"])
def test_model_built_under_keras_mixed_float16_converts_whole_and_gets_skip_only(target):
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _mlp()
    keras.mixed_precision.set_global_policy("float32")
    converted = kmp.convert(model, target, check=None)
    input_layer = converted._flatten_layers(include_self=False)[0]
    assert isinstance(input_layer, keras.layers.InputLayer)
    assert input_layer.compute_dtype == converted.layers[0].compute_dtype != "float16"
    converted.compile("adam", "mse")
    opt = converted.optimizer
    assert type(opt) is kmp.LossScaleOptimizer and opt.skip_only  # no dynamic 2^15 scale
    assert opt.initial_scale == 1.0 and not opt.dynamic


def test_noting_dtypes_leaves_layer_construction_and_auto_config_as_keras_has_them():
    class NoInit(keras.layers.Layer):  # no __init__ of its own: Keras reads the argspec
        def call(self, inputs):
            return inputs

    layer = NoInit(name="plain", dtype="float32")
    assert layer.get_config()["name"] == "plain"
    assert NoInit.from_config(layer.get_config()).name == "plain"
    assert kmp.keep_list.user_pins.chose_float32(layer)
    assert not kmp.keep_list.user_pins.chose_float32(NoInit())


def _large(n=256):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 4)) * 2e4 + 5e4).astype("float32")  # prices, populations


@pytest.mark.skipif(not TF, reason="JAX on CPU has no float16 dot")
def test_normalization_adapted_on_large_values_is_pinned_and_runs_finite():
    x = _large()
    norm = keras.layers.Normalization()
    norm.adapt(x)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(norm(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(hidden))
    mixed = kmp.convert(model, "mixed_float16")
    plan = mixed.precision_plan
    assert [(p.path, p.reason) for p in plan.pins] == [
        ("normalization", "keep_fp32 'normalization'")
    ]
    assert any("past float16's largest value 65504" in n for n in plan.notes), plan.notes
    got = keras.ops.convert_to_numpy(mixed(x[:64])).astype("float32")
    want = keras.ops.convert_to_numpy(model(x[:64]))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()


def test_normalization_adapt_under_keras_mixed_float16_works_and_names_the_fix():
    x = _large()
    batches = [x[i : i + 32] for i in range(0, len(x), 32)]  # Keras' adapt crashed here
    keras.mixed_precision.set_global_policy("mixed_float16")
    norm = keras.layers.Normalization()
    with pytest.warns(UserWarning, match=r"Normalization\(dtype='float32'\)"):
        norm.adapt(batches)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(norm.adapt_mean), x.mean(0), rtol=1e-5)
    # the fix it names: the layer computes in float32 and normalises finitely
    fixed = keras.layers.Normalization(dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fixed.adapt(batches)
    out = keras.ops.convert_to_numpy(fixed(x[:8]))
    assert np.isfinite(out).all() and np.abs(out).max() < 5


@keras.saving.register_keras_serializable(package="test_user_intent")
class ActivityRegularization(keras.layers.Layer):  # keras.io's training-loop guide
    def call(self, inputs):
        self.add_loss(1e-2 * keras.ops.sum(inputs))
        return inputs


@pytest.mark.skipif(not TF, reason="JAX on CPU has no float16 dot")
def test_added_losses_come_out_float32_and_finite_from_a_converted_model():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(64, activation="relu")(inputs)
    x = ActivityRegularization(name="activity")(x)
    x = keras.layers.Dense(8, activity_regularizer="l2")(x)
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    data = np.random.default_rng(0).normal(size=(64, 4)).astype("float32") * 200
    model(data)
    want = [float(keras.ops.convert_to_numpy(v)) for v in model.losses]
    assert want[0] / 1e-2 > 65504  # the guide's sum is past float16's range

    mixed = kmp.convert(model, "mixed_float16")
    pins = {p.path: p.reason for p in mixed.precision_plan.pins}
    assert pins["activity"].startswith("its call adds a loss")
    logits = mixed(data)
    dtypes = [keras.backend.standardize_dtype(v.dtype) for v in mixed.losses]
    assert dtypes == ["float32", "float32"]
    got = [float(keras.ops.convert_to_numpy(v)) for v in mixed.losses]
    np.testing.assert_allclose(got, want, rtol=2e-2)
    # the guide's own loop: a float32 loss plus the added ones
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
        np.zeros(64, "int32"), logits
    )
    total = loss + sum(mixed.losses)
    assert np.isfinite(float(keras.ops.convert_to_numpy(total)))


def _frozen_base_model():
    """keras.io's transfer-learning guide, small: a frozen conv base, a new head."""
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.SeparableConv2D(8, 3, padding="same", activation="relu")(x)
    base = keras.Model(inputs, x, name="base")
    base.trainable = False
    inputs = keras.Input((16, 16, 3))
    x = keras.layers.Rescaling(1 / 127.5, offset=-1)(inputs)
    x = keras.layers.GlobalAveragePooling2D()(base(x, training=False))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x)), base


@pytest.mark.skipif(not TF, reason="bfloat16 convolutions on CPU: TensorFlow")
def test_lean_convert_of_a_frozen_base_stores_its_kernels_in_bfloat16_and_runs():
    model, _ = _frozen_base_model()
    lean = kmp.convert(model, "lean_bfloat16")
    plan = lean.precision_plan
    assert plan.pins == [] and plan.check.pinned == {}  # nothing pinned to run
    base = lean.get_layer("base")
    dtypes = {"/".join(v.path.split("/")[-2:]): v.dtype for v in base.weights}
    kernels = [dtypes[k] for k in dtypes if k.endswith("kernel")]
    assert len(kernels) == 3 and set(kernels) == {"bfloat16"}, dtypes
    assert dtypes["batch_normalization/moving_mean"] == "float32", dtypes  # statistics
    lean.compile("adam", "mse")
    rng = np.random.default_rng(0)
    x, y = rng.uniform(0, 255, (16, 16, 16, 3)).astype("float32"), rng.normal(size=(16, 1))
    frozen = [keras.ops.convert_to_numpy(v) for v in base.weights]
    lean.fit(x, y.astype("float32"), epochs=2, verbose=0)
    after = [keras.ops.convert_to_numpy(v) for v in base.weights]
    assert all(np.array_equal(a, b) for a, b in zip(frozen, after, strict=True))
    # the guide's fine-tuning step: unfreeze, recompile, train: the base's kernels move
    base.trainable = True
    lean.compile(keras.optimizers.Adam(1e-3), "mse")
    assert type(lean.optimizer).__name__ == "LeanOptimizer"
    lean.fit(x, y.astype("float32"), epochs=1, verbose=0)
    kernel = [v for v in base.weights if v.path.endswith("kernel")][0]
    assert not np.array_equal(frozen[0], keras.ops.convert_to_numpy(kernel))


class _Breakable(keras.layers.Layer):
    broken = False

    def call(self, inputs):
        if self.broken:  # fails whatever its dtype: no pin can fix it
            raise TypeError("broken in every dtype")
        return inputs * 2.0


def test_run_check_names_the_layer_that_fails_in_float32_too_and_does_not_offer_check_none():
    from keras_mp.conversion import converter, runcheck

    inputs = keras.Input((4,))
    x = _Breakable(name="breakable")(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    policy = kmp.Policy("mixed_bfloat16")
    layers = {kmp.keep_list.addresses(model)[id(x)]: x for x in model.layers}

    def make_plan(exact):
        return kmp.keep_list.plan(model, policy, exact=[(layers[a], r) for a, r in exact.items()])

    def convert(the_plan):
        new = converter._converted(model, the_plan)
        new.get_layer("breakable").broken = True
        return new

    x = np.ones((2, 4), "float32")
    with pytest.raises(ValueError, match="'breakable', which fails in float32 too") as caught:
        runcheck.repair(model, make_plan, convert, x)
    assert "not a precision problem" in str(caught.value)
    assert "would only skip this check" in str(caught.value)


def _guide_model():
    base = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(8)],
        name="base_model",
    )
    base.trainable = False
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, name="head")(base(inputs, training=False))
    return keras.Model(inputs, outputs), base


def test_unfreezing_the_source_after_convert_is_named_at_compile():
    model, base_model = _guide_model()
    mixed = kmp.convert(model, "mixed_bfloat16", check=None)
    mixed.compile("adam", "mse")
    base_model.trainable = True  # the guide's fine-tuning step, on the user's handle
    with pytest.warns(UserWarning, match=r"model.get_layer\('base_model'\).trainable = True"):
        mixed.compile(keras.optimizers.Adam(1e-5), "mse")
    assert len(mixed.trainable_weights) == 2  # what the warning says: the head alone
    # done as it says, the warning goes
    mixed.get_layer("base_model").trainable = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixed.compile(keras.optimizers.Adam(1e-5), "mse")
    assert len(mixed.trainable_weights) == 6


def test_convert_in_place_makes_the_users_handles_the_trained_models():
    model, base_model = _guide_model()
    model.compile("adam", "mse")
    converted = kmp.convert(model, "mixed_bfloat16", in_place=True)
    assert converted is model and base_model.compute_dtype == "bfloat16"
    assert converted.precision_plan.policy.name == "mixed_bfloat16"
    assert type(model.optimizer) is kmp.LossScaleOptimizer  # compiled again, skip-only
    base_model.trainable = True
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    assert len(model.trainable_weights) == 6
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    kernel = keras.ops.convert_to_numpy(base_model.layers[0].kernel).copy()
    model.fit(x, y, epochs=1, verbose=0)
    assert not np.array_equal(kernel, keras.ops.convert_to_numpy(base_model.layers[0].kernel))


class _RunningSum(keras.layers.Layer):
    def build(self, input_shape):
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, inputs):
        self.total.assign_add(keras.ops.sum(inputs))
        return inputs


@pytest.mark.skipif(not TF, reason="JAX on CPU has no float16 dot")
def test_a_running_sum_in_a_converted_layer_adds_in_float32():
    inputs = keras.Input((16,))
    x = _RunningSum(name="running")(keras.layers.Dense(16, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    mixed = kmp.convert(model, "mixed_float16", check=None)
    pins = {p.path: p.reason for p in mixed.precision_plan.pins}
    assert pins["running"].startswith("its call updates a variable of its own")
    x = np.abs(np.random.default_rng(0).normal(size=(64, 16))).astype("float32") * 100
    for _ in range(3):
        model(x)
        mixed(x)
    want = float(keras.ops.convert_to_numpy(model.get_layer("running").total))
    got = float(keras.ops.convert_to_numpy(mixed.get_layer("running").total))
    assert want > 65504  # a float16 sum would be inf
    assert abs(got - want) < 1e-3 * want


def test_keras_own_mixed_policy_warns_that_outputs_are_low_and_convert_returns_float32():
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(5, activation="softmax")(inputs))
    with pytest.warns(UserWarning, match=r"returns float16 outputs.*np.random.choice"):
        model.compile("adam", "sparse_categorical_crossentropy")
    keras.mixed_precision.set_global_policy("float32")
    mixed = kmp.convert(model, "mixed_float16", check=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixed.compile("adam", "sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(64, 16)).astype("float32")
    low = model.predict(x, verbose=0)
    probabilities = mixed.predict(x, verbose=0)
    assert low.dtype == np.float16 and probabilities.dtype == np.float32
    # float16 probabilities sum to 1 within ~1e-3 (np.random.choice refuses them)
    assert np.abs(low.astype("float64").sum(1) - 1).max() > 1e-4
    assert np.abs(probabilities.astype("float64").sum(1) - 1).max() < 1e-6


def test_a_layer_loaded_from_a_config_with_a_string_dtype_is_not_a_user_pin():
    config = keras.saving.serialize_keras_object(keras.layers.Dense(4, name="loaded"))
    config["config"]["dtype"] = "float32"  # as older files save it
    loaded = keras.saving.deserialize_keras_object(config)
    assert loaded.name == "loaded" and not kmp.keep_list.user_pins.chose_float32(loaded)
