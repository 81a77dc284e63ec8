"""The factored second moment of the lean state: `LeanOptimizer(moments="int4_factored")`.

The rule against a float64 NumPy reference of Adafactor's factored estimate inside Adam,
the accumulators' shapes and bytes (`kmp.state_bytes`), a skipped step, save / load /
resume bit for bit, and (in a subprocess: device counts are fixed when JAX starts)
`ModelParallel` and `shard_over_data` on 4 host devices.

    python tests/test_lean_factored.py jax    # the subprocess side, prints one JSON line
"""

import json
import math
import os
import subprocess
import sys

if __name__ == "__main__":  # the subprocess side: its devices, set before imports
    os.environ["KERAS_BACKEND"] = "jax" if sys.argv[1:] == ["jax"] else "tensorflow"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if sys.argv[1:] == ["mirrored"]:  # 2 logical CPUs, before TensorFlow starts
        import tensorflow as tf

        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 2,
        )

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp.lean import codecs as lean_codecs  # noqa: E402
from keras_mp.lean import factored  # noqa: E402
from keras_mp.lean.packed_step import SMALL  # noqa: E402
from keras_mp.lean.rule import Hyper, Static, lean_rule  # noqa: E402

B1, B2, EPS = 0.9, 0.999, 1e-7


def np_(x):
    return np.asarray(keras.ops.convert_to_numpy(x), dtype="float32")


def reference(w, grads, lr, wd=0.0, factor=True):
    """Float64 AdamW with Adafactor's factored second moment (`factor`) or Adam's own,
    Keras' formula: bias correction folded into the step size, epsilon outside the root."""
    w = np.asarray(w, "float64")
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    # the two largest dimensions (a, b): one average per index of every other dimension
    a, b = sorted(sorted(range(w.ndim), key=lambda i: (-w.shape[i], i))[:2])
    rows = np.zeros(np.delete(w.shape, b))
    cols = np.zeros(np.delete(w.shape, a))
    for t, g in enumerate(grads, 1):
        g = np.asarray(g, "float64")
        decay = -w * wd * lr
        m = m + (g - m) * (1 - B1)
        if factor:
            rows = rows + ((g * g).mean(b) - rows) * (1 - B2)
            cols = cols + ((g * g).mean(a) - cols) * (1 - B2)
            r = np.expand_dims(rows, b)
            v = r * np.expand_dims(cols, a) / r.mean(a, keepdims=True)
        else:
            v = v + (g * g - v) * (1 - B2)
        alpha = lr * math.sqrt(1 - B2**t) / (1 - B1**t)
        w = w + decay - alpha * m / (np.sqrt(v) + EPS)
    return w, rows, cols


def _gradients(shape, steps, seed=0):
    # rows and columns of different scales, and noise: G**2 is far from rank 1, so the
    # factored estimate differs from Adam's by much more than the tolerances below
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(size=shape[:-1] + (1,))) * np.exp(rng.normal(size=shape[-1:]))
    return [(scale * rng.normal(size=shape)).astype("float32") for _ in range(steps)]


# -- the rule -------------------------------------------------------------------------------


def _static(shape):
    """A float32 weight and first moment, the second moment factored."""
    blocks = lean_codecs.blocks_for(shape, 128)
    return Static(shape, "float32", "float32", factored.FORMAT, blocks)


@pytest.mark.parametrize(
    "shape, rows_shape, cols_shape",
    [((24, 40), (24,), (40,)), ((3, 16, 12), (3, 16), (3, 12)), ((16, 3, 12), (16, 3), (3, 12))],
)
def test_rule_matches_float64_reference(shape, rows_shape, cols_shape):
    """`lean_rule` with a float32 weight and first moment (no rounding anywhere) and the
    factored second moment: 5 AdamW steps within 1e-5 of float64; rank 3 is factored over
    its two largest dimensions (one row/column average per index of the third)."""
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=shape).astype("float32")
    grads = _gradients(shape, 5)
    lr, wd = 1e-2, 0.1
    static = _static(shape)
    hyper = Hyper("adamw", "stochastic", B1, B2, EPS, 0.0, False)
    assert factored.accumulator_shapes(shape) == (rows_shape, cols_shape)
    state = {
        "weight": w0,
        "m": np.zeros(shape, "float32"),
        "v": np.zeros(rows_shape, "float32"),
        "v_scale": np.zeros(cols_shape, "float32"),
    }
    for t, g in enumerate(grads):
        values = {
            **{k: keras.ops.convert_to_tensor(v) for k, v in state.items()},
            "grad": keras.ops.convert_to_tensor(g),
            "lr": keras.ops.convert_to_tensor(lr, "float32"),
            "iterations": keras.ops.convert_to_tensor(t, "int32"),
            "seed": keras.ops.convert_to_tensor(7, "int32"),
            "weight_decay": keras.ops.convert_to_tensor(wd, "float32"),
        }
        state = {k: np_(v) for k, v in lean_rule(static, hyper, values).items()}
    want, rows, cols = reference(w0, grads, lr, wd)
    np.testing.assert_allclose(state["v"], rows, rtol=1e-5)
    np.testing.assert_allclose(state["v_scale"], cols, rtol=1e-5)
    moved = np.abs(want - w0).mean()
    assert np.abs(state["weight"] - want).max() < 1e-3 * moved
    adam, _, _ = reference(w0, grads, lr, wd, factor=False)
    assert np.abs(adam - want).mean() > 0.05 * moved  # the factored rule is not Adam's


def test_rule_keeps_the_accumulators_on_a_nonfinite_gradient():
    shape = (8, 16)
    static = _static(shape)
    hyper = Hyper("adam", "stochastic", B1, B2, EPS, 0.0, False)
    rng = np.random.default_rng(0)
    g = rng.normal(size=shape).astype("float32")
    g[3, 5] = np.nan
    state = {
        "weight": rng.normal(size=shape).astype("float32"),
        "m": rng.normal(size=shape).astype("float32"),
        "v": rng.uniform(1, 2, size=(8,)).astype("float32"),
        "v_scale": rng.uniform(1, 2, size=(16,)).astype("float32"),
    }
    values = {
        **{k: keras.ops.convert_to_tensor(v) for k, v in state.items()},
        "grad": keras.ops.convert_to_tensor(g),
        "lr": keras.ops.convert_to_tensor(1e-2, "float32"),
        "iterations": keras.ops.convert_to_tensor(4, "int32"),
        "seed": keras.ops.convert_to_tensor(0, "int32"),
    }
    out = lean_rule(static, hyper, values)
    assert set(out) == set(state)
    for k in state:
        np.testing.assert_array_equal(np_(out[k]), state[k])


# -- the optimizer --------------------------------------------------------------------------


def test_moments_choice_is_validated():
    with pytest.raises(ValueError, match=r"`moments`='int3'.*'int4_factored'"):
        kmp.LeanOptimizer(keras.optimizers.AdamW(), moments="int3")
    assert factored.MIN_SIZE == SMALL  # the factored matrices are those pack_small leaves


def _opt_variable_names(opt):
    return {v.path.split("/")[-1]: tuple(v.shape) for v in opt.variables}


def test_optimizer_applies_the_factored_rule():
    """One float32 kernel (updated exactly; only its moments are compressed), 4 steps: the
    stored row/column averages equal the float64 reference, and each step moves the
    weight as float64 AdamW does from the stored state (the first moment decoded from its
    4-bit codes, the second factored) within 1e-4 of the step; Adam's unfactored second
    moment would move it a third of the movement away."""
    shape = (256, 512)
    w0 = np.random.default_rng(2).normal(size=shape).astype("float32")
    w = keras.Variable(w0, name="kernel")
    opt = kmp.LeanOptimizer(keras.optimizers.Adam(1e-2), moments="int4_factored")
    opt.build([w])
    names = _opt_variable_names(opt)
    assert names["kernel_velocity_rows"] == (256,) and names["kernel_velocity_cols"] == (512,)
    assert "kernel_velocity" not in names and "kernel_momentum" in names  # 4-bit codes
    slot = opt._slots[0]
    assert slot["v"][0] == factored.FORMAT and slot["m"][0] == "int4"
    grads = [np.random.default_rng(3 + t).normal(size=shape).astype("float32") for t in range(4)]
    rows, cols = np.zeros(256), np.zeros(512)
    for t, g in enumerate(grads, 1):
        _, codes, scales = slot["m"]
        m = lean_codecs.decode_moment(
            codes.value, scales.value, "int4", True, shape, slot["blocks"]
        )
        m = np.asarray(np_(m), "float64")
        before = np.asarray(np_(w.value), "float64")
        opt.apply([keras.ops.convert_to_tensor(g)], [w])
        g = np.asarray(g, "float64")
        m = m + (g - m) * (1 - B1)
        rows = rows + ((g * g).mean(-1) - rows) * (1 - B2)
        cols = cols + ((g * g).mean(-2) - cols) * (1 - B2)
        v = rows[:, None] * cols[None, :] / rows.mean()
        step = -1e-2 * math.sqrt(1 - B2**t) / (1 - B1**t) * m / (np.sqrt(v) + EPS)
        full = -1e-2 * math.sqrt(1 - B2**t) / (1 - B1**t) * m / (np.abs(g) + EPS)
        got = np_(w.value) - before
        assert np.abs(got - step).max() < 1e-4 * np.abs(step).max(), t
        if t == 1:  # Adam's second moment at the first step: |g|
            assert np.abs(full - step).mean() > 0.3 * np.abs(step).mean()
        np.testing.assert_allclose(np_(slot["v"][1].value), rows, rtol=1e-5)
        np.testing.assert_allclose(np_(slot["v"][2].value), cols, rtol=1e-5)
    # a step with a NaN gradient leaves the kernel and both averages as they were
    before = [np_(v.value) for v in opt.variables if "kernel" in v.path] + [np_(w.value)]
    bad = grads[0].copy()
    bad[0, 0] = np.nan
    opt.apply([keras.ops.convert_to_tensor(bad)], [w])
    after = [np_(v.value) for v in opt.variables if "kernel" in v.path] + [np_(w.value)]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert int(np_(opt.skipped_steps.value)) == 1


def _model(seed=0):
    """64 -> Dense(1024) (65,536 values: factored) -> Dense(3) (packed, 4-bit), lean."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((64,))
    h = keras.layers.Dense(1024, activation="relu", name="up")(inputs)
    outputs = keras.layers.Dense(3, name="head")(h)
    return kmp.convert(keras.Model(inputs, outputs), "lean_bfloat16")


def _data(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 64)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")


def test_small_tensors_keep_the_int4_state_bit_for_bit():
    """A model with no tensor of 65,536 values (as `keras-mp compare --model transformer`,
    10,090 parameters) trains exactly as with `moments="int4"`: same variables, same bits."""
    from _lean_helpers import mlp, np_, train

    out = {}
    for moments in ("int4", "int4_factored"):
        model = kmp.convert(mlp(), "lean_bfloat16")
        opt = kmp.LeanOptimizer(keras.optimizers.AdamW(1e-2), moments=moments)
        weights = train(model, opt, steps=4)
        out[moments] = weights + [np_(v.value) for v in opt.variables]
        assert not any(v.path.endswith("_rows") for v in opt.variables)
    assert len(out["int4"]) == len(out["int4_factored"])
    for a, b in zip(out["int4"], out["int4_factored"]):
        np.testing.assert_array_equal(a, b)


def test_state_bytes_counts_the_accumulators():
    """The factored kernel's second moment is 4 * (64 + 1024) bytes instead of 4-bit codes
    and their scales (65,536 / 2 + 4 * 512); everything else is as with `"int4"`."""
    sizes = {}
    for moments in ("int4", "int4_factored"):
        model = _model()
        model.compile(optimizer=kmp.LeanOptimizer(keras.optimizers.AdamW(), moments=moments))
        sizes[moments] = kmp.state_bytes(model)
    n = 64 * 1024
    saved = n // 2 + 4 * (n // 128) - 4 * (64 + 1024)
    assert sizes["int4"].optimizer - sizes["int4_factored"].optimizer == saved
    assert sizes["int4"].weights == sizes["int4_factored"].weights
    # 2 bytes of weights, 0.53 of 4-bit first moment (and 0.53 of second, int4)
    assert sizes["int4_factored"].per_parameter < 2.63 and sizes["int4"].per_parameter > 3.06


def test_gpt2_state_bytes():
    """keras_hub's GPT-2 from small sizes: every kernel of 65,536 values or more is
    factored (the attention's rank-3 kernels over their two largest dimensions: the
    query kernel (256, 4, 64) keeps (256, 4) and (4, 64) averages)."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=1024, num_layers=2, num_heads=4, hidden_dim=256,
        intermediate_dim=1024, max_sequence_length=64,
    )
    model = kmp.convert(backbone, "lean_bfloat16")
    per = {}
    for moments in ("int4", "int4_factored"):
        opt = kmp.LeanOptimizer(keras.optimizers.AdamW(), moments=moments)
        per[moments] = kmp.state_bytes(model, opt).per_parameter
        if moments == "int4_factored":
            rows = [v for v in opt.variables if v.path.endswith("_rows")]
            big = [
                v for v in model.trainable_variables
                if len(v.shape) >= 2 and math.prod(v.shape) >= SMALL
            ]
            assert len(rows) == len(big) > 0
            shapes = {v.path.split("/")[-1]: tuple(v.shape) for v in opt.variables}
            query = "transformer_layer_0_self_attention_query_kernel_velocity"
            assert shapes[query + "_rows"] == (256, 4) and shapes[query + "_cols"] == (4, 64)
    # 2 bytes of weights, 0.53 of 4-bit first moment, 0.53 of 4-bit second moment
    assert 3.0 < per["int4"] < 3.2 and 2.5 < per["int4_factored"] < 2.65, per


def test_the_default_is_factored():
    """By the rule (BENCHMARKS 17: within 1% of float32 on 3 seeds of text_lm.py), the
    lean state `compile("adamw")` gets: stochastic rounding, int4 + factored moments."""
    model = _model()
    model.compile(optimizer="adamw", loss="mse")
    opt = model.optimizer
    assert (opt.rounding, opt.moments) == ("stochastic", "int4_factored")
    assert kmp.state_bytes(model).per_parameter < 2.63


def test_save_load_and_resume_bit_identical(tmp_path):
    from _lean_helpers import assert_resume_bit_identical, train_batches

    x, y = _data()
    model = _model()
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(1e-3), moments="int4_factored")
    model.compile(
        optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    train_batches(model, x, y, 0, 3)
    rows = next(v for v in opt.variables if v.path.endswith("up_kernel_velocity_rows"))
    assert np.all(np_(rows.value) > 0)  # trained: the averages hold values
    loaded = assert_resume_bit_identical(model, str(tmp_path / "factored.keras"), x, y)
    assert loaded.optimizer.moments == "int4_factored"
    assert loaded.optimizer.get_config()["moments"] == "int4_factored"


# -- sharding (JAX, 4 host devices) ---------------------------------------------------------


def _jax_worker() -> None:
    """Trains `_model`'s sibling (two factored kernels) on 1 device, under `ModelParallel`
    (1 x 4, the kernels split on their columns / rows), with `shard_over_data` on
    `DataParallel`, and on a 2 x 2 mesh with both; prints the weights, the averages and
    their shardings as one JSON line."""
    import jax

    devices = jax.devices()
    assert len(devices) == 4

    def layouts(shape):
        mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["up/kernel"] = (None, "model")
        layout_map["down/kernel"] = ("model", None)
        return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype("float32")
    y = rng.normal(size=(64, 64)).astype("float32")

    def run(distribution, shard=False):
        keras.distribution.set_distribution(distribution)
        try:
            keras.utils.set_random_seed(0)
            inputs = keras.Input((64,))
            h = keras.layers.Dense(1024, activation="relu", name="up")(inputs)
            outputs = keras.layers.Dense(64, name="down")(h)
            model = kmp.convert(keras.Model(inputs, outputs), "lean_bfloat16")
            opt = kmp.LeanOptimizer(
                keras.optimizers.AdamW(1e-2), moments="int4_factored", shard_over_data=shard
            )
            model.compile(optimizer=opt, loss="mse")
            init = [np_(v.value) for v in model.trainable_variables]
            model.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0)
            averages = {
                v.path.split("/")[-1]: v
                for v in opt.variables
                if v.path.endswith(("_rows", "_cols"))
            }
            momentum = next(v for v in opt.variables if v.path.endswith("up_kernel_momentum"))
            return {
                "weights": [np_(w).tolist() for w in opt.weights_float32()],
                "init": [w.tolist() for w in init],
                "averages": {k: np_(v.value).tolist() for k, v in averages.items()},
                "replicated": all(v.value.sharding.is_fully_replicated for v in averages.values()),
                "momentum_split": not momentum.value.sharding.is_fully_replicated,
            }
        finally:
            keras.distribution.set_distribution(None)

    out = {
        "single": run(None),
        "model_parallel": run(layouts((1, 4))),
        "data_parallel_split": run(keras.distribution.DataParallel(devices=devices), True),
        "model_parallel_2x2_split": run(layouts((2, 2)), True),
    }
    print(json.dumps(out))


def _worker(mode: str) -> dict:
    """Runs this file's subprocess side in `mode` and returns its JSON line."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), mode],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_matches(out: dict) -> None:
    """Each distributed run's averages within 1% (mean) and its weights within 3% of the
    movement of the one-device run's: bfloat16 gradients summed across devices in another
    order, and the stochastic roundings turning a one-ulp difference into another draw."""
    single = out.pop("single")
    for name, entry in out.items():
        for key, value in single["averages"].items():
            got, want = np.array(entry["averages"][key]), np.array(value)
            assert np.abs(got - want).mean() < 1e-2 * np.abs(want).mean(), (name, key)
        gap = np.mean([
            np.abs(np.array(a) - np.array(b)).mean()
            for a, b in zip(entry["weights"], single["weights"])
        ])
        moved = np.mean([
            np.abs(np.array(b) - np.array(c)).mean()
            for b, c in zip(single["weights"], single["init"])
        ])
        assert moved > 0 and gap < 0.03 * moved, (name, gap, moved)


@pytest.mark.slow  # about 40 s: five trainings in a JAX process with 4 host devices
@pytest.mark.tf_only  # the subprocess picks its own backend: run once per suite
def test_sharded_factored_state_matches_one_device():
    out = _worker("jax")
    assert set(out["single"]["averages"]) == {
        "up_kernel_velocity_rows", "up_kernel_velocity_cols",
        "down_kernel_velocity_rows", "down_kernel_velocity_cols",
    }
    for name, entry in out.items():
        if name != "single":
            assert entry["replicated"], name  # the averages: whole on every device
            assert entry["momentum_split"], name  # the 4-bit first moment: split
    _assert_matches(out)


def _mirrored_worker() -> None:
    """The same model on one device and under a `MirroredStrategy` of 2 logical CPUs
    (TensorFlow's per-variable update in the strategy's update context): one JSON line."""
    import contextlib

    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype("float32")
    y = rng.normal(size=(64, 64)).astype("float32")

    def run(strategy):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            inputs = keras.Input((64,))
            h = keras.layers.Dense(1024, activation="relu", name="up")(inputs)
            outputs = keras.layers.Dense(64, name="down")(h)
            model = kmp.convert(keras.Model(inputs, outputs), "lean_bfloat16")
            opt = kmp.LeanOptimizer(keras.optimizers.AdamW(1e-2), moments="int4_factored")
            model.compile(optimizer=opt, loss="mse")
        init = [np_(v.value).tolist() for v in model.trainable_variables]
        model.fit(x, y, batch_size=16, shuffle=False, epochs=1, verbose=0)
        return {
            "weights": [np_(w).tolist() for w in opt.weights_float32()],
            "init": init,
            "averages": {
                v.path.split("/")[-1]: np_(v.value).tolist()
                for v in opt.variables
                if v.path.endswith(("_rows", "_cols"))
            },
        }

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    out = {"single": run(None), "mirrored": run(mirrored)}
    print(json.dumps(out))


@pytest.mark.slow  # about 30 s: two trainings in a TensorFlow process with 2 logical CPUs
@pytest.mark.tf_only
def test_mirrored_factored_state_matches_one_device():
    out = _worker("mirrored")
    assert set(out["mirrored"]["averages"]) == set(out["single"]["averages"]) != set()
    _assert_matches(out)


if __name__ == "__main__":
    {"jax": _jax_worker, "mirrored": _mirrored_worker}[sys.argv[1]]()
