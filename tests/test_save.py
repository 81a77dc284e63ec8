"""Save / load round trips, bit-identical resume, and corrupt files.

Resume runs use the low-precision policy of the backend (mixed_float16 on TensorFlow,
compiled with XLA; mixed_bfloat16 on JAX, whose CPU has no float16 dot).
"""

import json
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_mp as kmp

LOW = "mixed_float16" if BACKEND == "tensorflow" else "mixed_bfloat16"
RNG = np.random.default_rng(0)


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in variables]


def _state(model):
    """Every value training depends on: weights, optimizer slots, scale and counters."""
    names = [v.path for v in model.variables] + [v.path for v in model.optimizer.variables]
    return names, _values(model.variables) + _values(model.optimizer.variables)


def _assert_same_state(expected, actual):
    (names, want), (_, got) = expected, actual
    assert len(want) == len(got), (len(want), len(got))
    diff = [
        n for n, a, b in zip(names, want, got) if a.shape != b.shape or not np.array_equal(a, b)
    ]
    assert not diff, f"state differs in {diff}"


# --------------------------------------------------------------------------------------
# Round trips of every keras_mp object through model.save / keras.models.load_model
# --------------------------------------------------------------------------------------


def _dense_model(dtype=None):
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", dtype=dtype)(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, dtype=dtype)(x))


def case_loss_scale_optimizer():
    model = _dense_model()
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.AdamW(1e-3),
        initial_scale=2.0**10,
        growth_interval=2,
        growth_factor=4.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=2.0**20,
        hysteresis=2,
    )
    model.compile(optimizer=opt, loss="mse", run_eagerly=True)
    return model, (RNG.normal(size=(8, 6)), RNG.normal(size=(8, 3)))


def case_policy_as_layer_dtype():
    policy = kmp.Policy("mixed_bfloat16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("*head*",))
    model = _dense_model(dtype=policy)
    return model, None


def case_convert():
    base = keras.Sequential(
        [
            keras.Input((5, 6)),
            keras.layers.Dense(8),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(4, activation="softmax", name="head"),
        ]
    )
    return kmp.convert(base, "mixed_bfloat16"), None


def case_float32_wrapper():
    from keras_mp import layers as kl

    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((6,))
    x = kl.Float32(keras.layers.LayerNormalization())(keras.layers.Dense(8)(inputs))
    outputs = kl.Float32(keras.layers.Dense(3), output_dtype="float32")(x)
    return keras.Model(inputs, outputs), None


def case_softmax_and_attention():
    from keras_mp import layers as kl

    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((5, 8))
    x = kl.MultiHeadAttention(num_heads=2, key_dim=4, dropout=0.1)(inputs, inputs)
    outputs = kl.Softmax(axis=-1)(keras.layers.Dense(3)(x))
    return keras.Model(inputs, outputs), None


def case_stock_attention_converted():
    inputs = keras.Input((5, 8))
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
    outputs = keras.layers.Softmax()(keras.layers.Dense(3)(x))
    return kmp.convert(keras.Model(inputs, outputs), "mixed_bfloat16"), None


def case_float8():
    """FP8 layers (keras_mp.float8, if present) with trained scales and amax histories."""
    float8 = pytest.importorskip("keras_mp.float8")
    base = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )
    model = kmp.convert(base, "mixed_bfloat16")
    float8.apply_float8(model)
    model.compile(optimizer="adam", loss="mse", run_eagerly=True)
    model.fit(RNG.normal(size=(8, 6)), RNG.normal(size=(8, 3)), batch_size=4, verbose=0)
    # No optimizer comparison: its slots follow the variable order, which differs here.
    return model, None


def case_global_policy():
    kmp.set_global_policy("mixed_bfloat16")
    try:
        return _dense_model(), None
    finally:
        kmp.set_global_policy("float32")  # kmp keeps its own global besides Keras'


def _loss_case(name, y):
    def case():
        from keras_mp import losses as kl

        model = _dense_model()
        model.compile(optimizer="sgd", loss=getattr(kl, name)(from_logits=True), run_eagerly=True)
        return model, (RNG.normal(size=(8, 6)), y)

    case.__name__ = f"case_loss_{name}"
    return case


CASES = [
    case_loss_scale_optimizer,
    case_policy_as_layer_dtype,
    case_convert,
    case_float32_wrapper,
    case_softmax_and_attention,
    case_stock_attention_converted,
    case_float8,
    case_global_policy,
    _loss_case("SparseCategoricalCrossentropy", RNG.integers(0, 3, (8,))),
    _loss_case("CategoricalCrossentropy", np.eye(3)[RNG.integers(0, 3, (8,))]),
    _loss_case("BinaryCrossentropy", RNG.integers(0, 2, (8, 3)).astype("float32")),
]


def _layer_facts(model):
    """(name, class, dtype policy, config) of every layer, nested ones included.

    Names of top-level layers only, not paths: layers rebuilt by `load_model` outside
    their model's name scope get shorter paths (`dense` for `sequential/dense`), and
    sublayers created in `build` (e.g. attention's softmax) get fresh automatic names.
    Configs go through JSON (tuples become lists).

    Policies are compared by name and dtypes: Keras' `Operation.from_config` rebuilds any
    non-quantized layer policy from its name, so a `kmp.Policy` given as a layer dtype
    comes back as the `keras.DTypePolicy` of the same name (same compute and variable
    dtypes; the keep-list only matters to `convert`, which gives layers Keras policies).
    """
    facts = []
    top = {id(layer) for layer in model.layers}
    for layer in model._flatten_layers(include_self=False):
        config = layer.get_config()
        config.pop("name", None)
        config.pop("dtype", None)
        policy = layer.dtype_policy
        policy_id = (policy.name, policy.compute_dtype, policy.variable_dtype)
        if isinstance(layer, keras.layers.InputLayer):
            policy_id = None  # takes the global policy of the moment; computes nothing
        config = json.loads(json.dumps(config))
        name = layer.name if id(layer) in top else None
        cls = f"{type(layer).__module__}.{type(layer).__name__}"
        facts.append((name, cls, policy_id, config))
    return facts


def _weights_by_layer(model):
    """{(layer index in the walk, variable name): value}: FP8 layers, rebuilt by
    `load_model`, create their variables in another order than `apply_float8` did."""
    out = {}
    for i, layer in enumerate(model._flatten_layers(include_self=False)):
        for v in layer._trainable_variables + layer._non_trainable_variables:
            out[(i, v.name)] = keras.ops.convert_to_numpy(v.value)
    return dict(sorted(out.items()))


def test_policy_round_trips_through_keras_serialization():
    policy = kmp.Policy("mixed_bfloat16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("*head*",))
    config = keras.saving.serialize_keras_object(policy)
    assert config["registered_name"] == "keras_mp>Policy"
    restored = keras.saving.deserialize_keras_object(json.loads(json.dumps(config)))
    assert restored == policy and type(restored) is kmp.Policy


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_keras_mp_objects_round_trip_without_custom_objects(case, tmp_path):
    model, data = case()
    keras.config.set_dtype_policy("float32")
    if data is not None:
        model.fit(*data, batch_size=4, epochs=1, verbose=0)  # builds optimizer state
    path = str(tmp_path / "m.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Skipping variable loading for optimizer"
        loaded = keras.models.load_model(path)

    assert _layer_facts(loaded) == _layer_facts(model)
    want, got = _weights_by_layer(model), _weights_by_layer(loaded)
    assert list(got) == list(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=str(key))
    x = RNG.normal(size=(4,) + tuple(model.inputs[0].shape[1:])).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded(x, training=False)),
        keras.ops.convert_to_numpy(model(x, training=False)),
    )
    if data is not None:
        assert type(loaded.optimizer) is type(model.optimizer)
        assert loaded.optimizer.get_config() == model.optimizer.get_config()
        _assert_same_state(_state(model), _state(loaded))
        assert type(loaded.loss) is type(model.loss)
        if hasattr(model.loss, "get_config"):
            assert loaded.loss.get_config() == model.loss.get_config()


# --------------------------------------------------------------------------------------
# Resume: the same next steps as never stopping
# --------------------------------------------------------------------------------------

INITIAL_SCALE = 2.0**20  # below max_scale=2**24: it can grow (BF16) or back off (FP16)
X = RNG.normal(size=(48, 16)).astype("float32")
X[20, 3] = np.nan  # batch 2 of every epoch has a non-finite gradient: a skipped step
Y = RNG.integers(0, 4, (48,))
FIT = dict(batch_size=8, shuffle=False, verbose=0)


def _make_resume_model():
    """Same weights every call; the loss scale moves both ways within one epoch."""
    keras.config.set_dtype_policy(LOW)
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    )
    opt = kmp.LossScaleOptimizer(
        keras.optimizers.AdamW(1e-2),
        initial_scale=INITIAL_SCALE,
        growth_interval=2,
        hysteresis=2,
    )
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A run that never stops, saved three ways after epoch 1 without disturbing it.

    Returns the states after epoch 1 and epoch 2, the epoch-1 telemetry and the paths of
    the `BackupAndRestore` backup, the `.keras` file and (TensorFlow) the
    `tf.train.Checkpoint` written after epoch 1.
    """
    root = tmp_path_factory.mktemp("resume")
    paths = dict(backup=str(root / "backup"), keras=str(root / "half.keras"))
    model = _make_resume_model()
    backup = keras.callbacks.BackupAndRestore(paths["backup"], delete_checkpoint=False)
    model.fit(X, Y, epochs=1, callbacks=[backup], **FIT)
    half = _state(model)
    model.save(paths["keras"])
    if BACKEND == "tensorflow":
        import tensorflow as tf

        paths["tf"] = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
            str(root / "ckpt" / "c")
        )
    opt = model.optimizer
    telemetry = dict(
        scale=float(keras.ops.convert_to_numpy(opt.loss_scale.value)),
        skipped=int(keras.ops.convert_to_numpy(opt.skipped_steps.value)),
        iterations=int(keras.ops.convert_to_numpy(opt.iterations.value)),
    )
    model.fit(X, Y, epochs=2, initial_epoch=1, **FIT)
    final = _state(model)
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
    return half, final, telemetry, paths


def test_first_half_changes_the_loss_scale(reference):
    telemetry = reference[2]
    # 6 steps, one NaN batch (+ FP16 overflows at 2**20 on TensorFlow): some skipped.
    assert telemetry["skipped"] >= 1
    assert telemetry["iterations"] + telemetry["skipped"] == 6
    assert telemetry["scale"] != INITIAL_SCALE


def test_resume_from_keras_file_is_bit_identical(reference):
    half, final, _, paths = reference
    resumed = keras.models.load_model(paths["keras"])
    assert isinstance(resumed.optimizer, kmp.LossScaleOptimizer)
    _assert_same_state(half, _state(resumed))  # scale, counters, mask, slots, weights
    resumed.fit(X, Y, epochs=2, initial_epoch=1, **FIT)
    _assert_same_state(final, _state(resumed))


def test_resume_with_backup_and_restore_is_bit_identical(reference):
    _, final, _, paths = reference
    restarted = _make_resume_model()  # a restarted job rebuilds the same model
    history = restarted.fit(
        X, Y, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(paths["backup"])], **FIT
    )
    assert len(history.history["loss"]) == 1  # only epoch 2 ran
    _assert_same_state(final, _state(restarted))


@pytest.mark.tf_only
def test_resume_with_tf_train_checkpoint_is_bit_identical(reference):
    import tensorflow as tf

    half, final, _, paths = reference
    prefix = paths["tf"]
    saved = {name for name, _ in tf.train.list_variables(prefix)}
    for attr in (
        "dynamic_scale",
        "step_counter",
        "hysteresis_left",
        "skipped_steps",
        "last_overflow_step",
        "nonfinite_mask",
    ):
        assert f"optimizer/{attr}/.ATTRIBUTES/VARIABLE_VALUE" in saved

    restarted = _make_resume_model()
    restarted.optimizer.build(restarted.trainable_variables)
    status = tf.train.Checkpoint(model=restarted, optimizer=restarted.optimizer).restore(prefix)
    status.assert_existing_objects_matched()
    _assert_same_state(half, _state(restarted))
    restarted.fit(X, Y, epochs=2, initial_epoch=1, **FIT)
    _assert_same_state(final, _state(restarted))


# --------------------------------------------------------------------------------------
# Corrupt, truncated and unknown files
# --------------------------------------------------------------------------------------


def _trained(seed=0, optimizer=None):
    """A compiled model with non-trivial weights, slots, scale and counters.

    Four eager steps (`run_eagerly=True`: no compilation to wait for), one of them with an
    infinite input, so a loss-scaling optimizer skips it.
    """
    keras.utils.set_random_seed(seed)
    model = _dense_model()
    model.compile(
        optimizer=optimizer
        or kmp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0**8, growth_interval=2
        ),
        loss="mse",
        run_eagerly=True,
    )
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(16, 6)).astype("float32")
    x[5, 0] = np.inf
    model.fit(x, rng.normal(size=(16, 3)), batch_size=4, shuffle=False, verbose=0)
    return model


@pytest.fixture
def saved(tmp_path):
    model = _trained()
    path = str(tmp_path / "m.keras")
    model.save(path)
    return model, path


def _rewrite_config(src, dst, edit):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if name == "config.json":
                config = json.loads(data)
                edit(config)
                data = json.dumps(config).encode()
            zout.writestr(name, data)


def test_truncated_keras_file_names_the_problem(saved, tmp_path):
    _, path = saved
    data = open(path, "rb").read()
    bad = str(tmp_path / "truncated.keras")
    open(bad, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated.keras.*not a valid .keras archive.*truncated"):
        kmp.saving.load_model(bad)


def test_damaged_keras_file_fails_its_crc_check(saved, tmp_path):
    _, path = saved
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("model.weights.h5")
    data = bytearray(open(path, "rb").read())
    data[info.header_offset + 100 + info.compress_size // 2] ^= 0xFF
    bad = str(tmp_path / "flipped.keras")
    open(bad, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="'model.weights.h5' fails its CRC check"):
        kmp.saving.load_model(bad)


@pytest.mark.parametrize("where", ["layer", "optimizer"])
def test_unknown_keras_mp_object_is_named(saved, tmp_path, where):
    _, path = saved

    def edit(config):
        if where == "layer":
            obj = config["config"]["layers"][1]
        else:
            obj = config["compile_config"]["optimizer"]
        obj.update(
            module="keras_mp.layers",
            class_name="DoesNotExist",
            registered_name="keras_mp>DoesNotExist",
        )

    bad = str(tmp_path / "unknown.keras")
    _rewrite_config(path, bad, edit)
    location = "config.config.layers[1]" if where == "layer" else "config.compile_config.optimizer"
    with pytest.raises(ValueError) as info:
        kmp.saving.load_model(bad)
    message = str(info.value)
    assert "'keras_mp>DoesNotExist'" in message
    assert f"(at {location})" in message
    assert "keras_mp>LossScaleOptimizer" in message  # lists the known objects


def test_unknown_third_party_object_points_to_custom_objects(saved, tmp_path):
    _, path = saved

    def edit(config):
        config["config"]["layers"][1]["registered_name"] = "acme>Widget"

    bad = str(tmp_path / "acme.keras")
    _rewrite_config(path, bad, edit)
    with pytest.raises(ValueError, match=r"'acme>Widget'.*custom_objects"):
        kmp.saving.load_model(bad)


def test_checked_load_model_loads_a_good_file(saved):
    model, path = saved
    loaded = kmp.saving.load_model(path)
    _assert_same_state(_state(model), _state(loaded))
    with pytest.raises(FileNotFoundError, match="missing.keras"):
        kmp.saving.load_model(path.replace("m.keras", "missing.keras"))


def _corrupt_optimizer_slot(src, dst):
    """A weights file whose layers load and whose last optimizer slot has a wrong shape."""
    data = open(src, "rb").read()
    open(dst, "wb").write(data)
    with h5py.File(dst, "r+") as f:
        group = f["optimizer/vars"]
        last = str(max(int(k) for k in group.keys()))
        del group[last]
        group[last] = np.zeros((7, 7), "float32")


def test_failed_load_weights_leaves_model_and_optimizer_untouched(tmp_path):
    source = _trained(seed=1)
    good = str(tmp_path / "source.weights.h5")
    source.save_weights(good)
    bad = str(tmp_path / "bad.weights.h5")
    _corrupt_optimizer_slot(good, bad)

    target = _trained(seed=2)
    before = _state(target)
    assert not all(
        np.array_equal(a, b) for a, b in zip(before[1], _state(source)[1]) if a.shape == b.shape
    )
    # Plain Keras raises, but only after assigning the layers: a half-restored model.
    with pytest.raises(ValueError, match="could not be loaded"):
        target.load_weights(bad)
    assert not np.array_equal(_values(target.weights)[0], before[1][0])

    target = _trained(seed=2)
    before = _state(target)
    with pytest.raises(ValueError, match=r"(?s)bad.weights.h5.*Nothing was changed"):
        kmp.saving.load_weights(target, bad)
    _assert_same_state(before, _state(target))

    truncated = str(tmp_path / "truncated.weights.h5")
    open(truncated, "wb").write(open(good, "rb").read()[:5000])
    with pytest.raises(ValueError, match="truncated"):
        kmp.saving.load_weights(target, truncated)
    _assert_same_state(before, _state(target))

    kmp.saving.load_weights(target, good)  # a good file loads completely
    _assert_same_state(_state(source), _state(target))


def test_load_weights_refuses_a_mismatched_optimizer_state(tmp_path):
    plain = _trained(optimizer=keras.optimizers.Adam(1e-2))  # no loss scaling
    path = str(tmp_path / "plain.weights.h5")
    plain.save_weights(path)
    target = _trained(seed=3)
    before = _state(target)
    with pytest.raises(ValueError, match="Skipping variable loading for optimizer"):
        kmp.saving.load_weights(target, path)
    _assert_same_state(before, _state(target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kmp.saving.load_weights(target, path, skip_mismatch=True)  # weights only, on request
    np.testing.assert_array_equal(_values(target.weights)[0], _values(plain.weights)[0])


def test_h5_reload_of_a_converted_model_restores_the_scaler_without_an_error(tmp_path, caplog):
    # Keras' .h5 loader builds the optimizer on the model's own (empty) variable list, so
    # the per-variable overflow mask has no entries: the saved 4-entry one used to make
    # set_weights raise, and the loader drop the whole optimizer state with a log line.
    model = kmp.convert(_dense_model(), "mixed_float16")
    model.compile(optimizer="adam", loss=keras.losses.MeanSquaredError())
    model.fit(RNG.normal(size=(8, 6)), RNG.normal(size=(8, 3)), epochs=2, verbose=0)
    opt = model.optimizer
    assert isinstance(opt, kmp.LossScaleOptimizer) and tuple(opt.nonfinite_mask.shape) == (4,)
    opt.dynamic_scale.assign(256.0)
    opt.skipped_steps.assign(3)
    opt.nonfinite_mask.assign(np.array([0, 1, 0, 1], "int32"))
    path = str(tmp_path / "converted.h5")
    model.save(path)
    with caplog.at_level("WARNING"):
        loaded = keras.models.load_model(path)
    assert "Error in loading the saved optimizer state" not in caplog.text
    restored = loaded.optimizer
    assert isinstance(restored, kmp.LossScaleOptimizer)
    assert float(restored.dynamic_scale) == 256.0 and int(restored.skipped_steps) == 3


def test_nested_blocks_keep_their_policy_label_through_a_keras_file(tmp_path):
    # ConvNeXt's shape: Sequential blocks (stem, downsampling) inside a functional model,
    # one of them inside a nested functional block (whose own label Keras does not save:
    # a functional config has no dtype).
    stem = keras.Sequential([keras.layers.Conv2D(4, 2, strides=2)], name="stem")
    down = keras.Sequential([keras.layers.Conv2D(8, 2, strides=2)], name="down")
    inner_in = keras.Input((4, 4, 4))
    stage = keras.Model(inner_in, down(keras.layers.ReLU()(inner_in)), name="stage")
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.GlobalAveragePooling2D()(stage(stem(inputs)))
    model = kmp.convert(keras.Model(inputs, keras.layers.Dense(2)(x)), "mixed_float16")

    def labels(m):
        return {"stem": m.get_layer("stem"), "down": m.get_layer("stage").get_layer("down")}

    before = {n: x.dtype_policy.name for n, x in labels(model).items()}
    assert before == {"stem": "mixed_float16", "down": "mixed_float16"}
    path = str(tmp_path / "nested.keras")
    model.save(path)
    loaded = kmp.saving.load_model(path)
    assert {n: x.dtype_policy.name for n, x in labels(loaded).items()} == before
    assert labels(loaded)["down"].layers[0].compute_dtype == "float16"
    x = RNG.normal(size=(2, 8, 8, 3)).astype("float32")
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(model.predict_on_batch(x)),
        keras.ops.convert_to_numpy(loaded.predict_on_batch(x)),
    )
