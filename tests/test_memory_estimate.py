"""`kmp.estimate_memory` and `keras-mp memory` (formerly `will_it_fit`, `keras-mp fit`): the
compiled train step's peak under each policy."""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import BACKEND

import keras_mp as kmp
from keras_mp.cli import main

ROOT = Path(__file__).resolve().parents[1]
jax_only = pytest.mark.skipif(BACKEND != "jax", reason="compiled in this process on JAX only")


def _model(vocab=256, d=32, seq=32):
    inputs = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, d, name="embed")(inputs)
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.Dense(4 * d, activation="gelu", name="ffn_in")(h)
    h = keras.layers.Dense(d, name="ffn_out")(h)
    return keras.Model(inputs, keras.layers.Dense(vocab, name="head")(h), name="small_lm")


@jax_only
def test_estimate_memory_orders_the_policies_and_sizes_the_state():
    model = _model()
    x = np.zeros((8, 32), "int32")
    report = kmp.estimate_memory(model, x)
    assert report.policies == ["float32", "mixed_bfloat16", "lean_bfloat16"]
    f32, mixed, lean = (report[p] for p in report.policies)
    assert lean.peak_bytes < mixed.peak_bytes < f32.peak_bytes
    params = model.count_params()
    assert f32.weights_bytes == 4 * params  # float32 weights
    assert lean.weights_bytes == 2 * params  # bfloat16 weights (the norm's too)
    # AdamW's two moments, and a few scalars: its own and the skip-only scaler's counters
    assert 8 * params <= f32.optimizer_bytes < 8 * params + 128
    # the default lean state: 4-bit moments, no compensation (27,296 against 200,456)
    assert lean.optimizer_bytes < 0.15 * f32.optimizer_bytes
    for row in report.rows:
        assert row.error is None and row.fits
        assert row.peak_bytes == row.weights_bytes + row.optimizer_bytes + row.temp_bytes
    assert report.exact is False and report.headroom_bytes == 0  # XLA:CPU: an estimate
    text = str(report)
    assert "lean_bfloat16" in text and "an estimate: XLA:CPU" in text and "yes" in text
    assert kmp.MemoryReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


@jax_only
def test_estimate_memory_materialises_no_weight_and_says_what_does_not_fit():
    model = _model()
    before = [np.asarray(v.value).copy() for v in model.weights]
    report = kmp.estimate_memory(
        model, np.zeros((4, 32), "int32"), policies="lean_bfloat16", memory_gib=0.0001
    )
    row = report["lean_bfloat16"]
    assert not row.fits and row.peak_bytes > 0.0001 * 2**30
    assert "NO" in str(report)
    for v, b in zip(model.weights, before):  # the model itself is untouched
        np.testing.assert_array_equal(np.asarray(v.value), b)
    assert model.weights[0].dtype == "float32"
    with pytest.raises(KeyError, match="float32"):
        report["float32"]


def test_estimate_memory_names_the_bad_argument():
    model = _model()
    x = np.zeros((2, 32), "int32")
    with pytest.raises(ValueError, match="`policies`"):
        kmp.estimate_memory(model, x, policies=("float64",))
    with pytest.raises(ValueError, match="`memory_gib`"):
        kmp.estimate_memory(model, x, memory_gib=-1)
    with pytest.raises(ValueError, match="`model`"):
        kmp.estimate_memory(keras.Sequential([keras.layers.Dense(2)]), x)


@jax_only
def test_cli_memory_prints_the_table_and_exits_1_when_a_policy_does_not_fit(tmp_path, capsys):
    path = str(tmp_path / "lm.keras")
    _model(seq=16).save(path)
    status = main(
        ["memory", path, "--batch-size", "4", "--policies", "float32,lean_bfloat16", "--json"]
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0
    rows = {r["policy"]: r for r in out["rows"]}
    assert rows["lean_bfloat16"]["peak_bytes"] < rows["float32"]["peak_bytes"]
    assert out["batch"] == [[4, 16]]
    argv = ["fit", path, "--batch-size", "4", "--policies", "lean_bfloat16", "--memory-gib"]
    status = main([*argv, "0.0001"])
    out = capsys.readouterr().out
    assert status == 1
    assert "lean_bfloat16" in out and "NO" in out and "batch [[4, 16]]" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["memory", "nosuch"], "neither a .keras file nor a bundled model"),
        (["memory", "missing.keras", "--batch-size", "2"], "no such model file"),
        (["memory", "tiny_gpt", "--policies", "float64"], "--policies: unknown"),
        (["fit", "tiny_gpt", "--batch-size", "0"], "must be positive"),
        (["fit", "tiny_gpt", "--input-shapes", "a,b"], "--input-shapes"),
        (["fit", "tiny_gpt", "--device", "missing.txtpb"], "--device: no such"),
        (["memory", "tiny_gpt", "--backend", "tensorflow"], "leave --backend out"),
    ],
)
def test_cli_memory_bad_arguments_give_one_line_and_status_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"keras-mp {argv[0]}: error:") and message in err
    assert len(err.splitlines()) == 1


def test_cli_memory_needs_a_batch_size_for_a_saved_model(tmp_path, capsys):
    path = tmp_path / "m.keras"
    path.write_bytes(b"")
    assert main(["memory", str(path)]) == 2
    assert "--batch-size is needed" in capsys.readouterr().err


@jax_only  # on TensorFlow the command reruns under JAX: the slow test below covers it
def test_cli_memory_sizes_a_compiled_model(tmp_path, capsys):
    # Keras compiled it from the saved compile config inside the no-variable scope: "You are
    # attempting to create a variable while in a stateless scope" (exit 2).
    path = str(tmp_path / "compiled.keras")
    model = _model(seq=8)
    model.compile(optimizer="adam", loss="mse")
    model.save(path)
    status = main(["memory", path, "--batch-size", "2", "--policies", "float32", "--json"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    row = json.loads(captured.out.strip().splitlines()[-1])["rows"][0]
    assert row["error"] is None and row["peak_bytes"] > 0


def _unreadable(tmp_path, kind):
    path = tmp_path / "m.keras"
    if kind == "directory":
        path.mkdir()
    elif kind == "text":
        path.write_text("not a model")
    elif kind == "truncated":
        _model(seq=8).save(str(tmp_path / "good.keras"))
        data = (tmp_path / "good.keras").read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "no config":
        import zipfile

        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("metadata.json", "{}")
    return str(path)


@pytest.mark.parametrize("kind", ["directory", "text", "truncated", "no config"])
def test_cli_memory_unreadable_model_file_is_one_line_and_status_3(tmp_path, capsys, kind):
    # A truncated file was a BadZipFile traceback with exit status 1 ("does not fit").
    path = _unreadable(tmp_path, kind)
    assert main(["memory", path, "--batch-size", "2"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("keras-mp memory: error:") and path in err
    assert len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.tf_only
def test_estimate_memory_on_tensorflow_sizes_the_saved_model_under_jax():
    model = _model(seq=16)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")  # saved compiled
    report = kmp.estimate_memory(
        model, np.zeros((4, 16), "int32"), policies=("float32", "lean_bfloat16")
    )
    assert report["lean_bfloat16"].peak_bytes < report["float32"].peak_bytes
    assert report.batch == [[4, 16]]


@jax_only
def test_remat_scope_recomputes_keras_mp_attention_on_jax():
    """Keras' JAX remat traces every argument of the call; keras_mp's MultiHeadAttention
    binds its Python flags first, so a RematScope naming it runs (stock Keras' layer
    raises) and gives the same gradients."""

    def grads(remat):
        keras.utils.set_random_seed(0)
        scope = keras.RematScope(mode="list_of_layers", layer_names=["attn"]) if remat else None
        with scope if scope else contextlib.nullcontext():
            inputs = keras.Input((8, 16))
            mha = kmp.layers.MultiHeadAttention(2, 8, name="attn")
            h = mha(inputs, inputs, use_causal_mask=True)
            model = keras.Model(inputs, keras.layers.Dense(3)(h))
        x = np.random.default_rng(0).standard_normal((2, 8, 16)).astype("float32")
        tv = [v.value for v in model.trainable_variables]

        def loss(tv):
            y, _ = model.stateless_call(tv, [v.value for v in model.non_trainable_variables], x)
            return keras.ops.mean(y**2)

        return jax.grad(loss)(tv)

    import jax

    for a, b in zip(grads(False), grads(True)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is None, reason="needs JAX's CUDA plugin"
)
def test_cli_memory_compiles_for_an_h200_without_one():
    """A GPU description (benchmarks/h200.txtpb) compiled for on a CPU: exact, 1 GiB kept."""
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT)}
    argv = ["memory", "tiny_gpt", "--device", str(ROOT / "benchmarks" / "h200.txtpb"), "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "keras_mp_launcher", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["exact"] is True and report["headroom_bytes"] == 2**30
    assert "H200" in report["device"] and report["memory_bytes"] > 100 * 2**30
    peaks = {r["policy"]: r["peak_bytes"] for r in report["rows"]}
    assert peaks["lean_bfloat16"] < peaks["mixed_bfloat16"] < peaks["float32"]


@jax_only
def test_estimate_memory_sizes_a_model_built_under_a_remat_scope():
    """The abstract copy keeps each layer's RematScope (Keras reads it when a layer is
    made), so the compiled step is the recomputing one: a different program. (On XLA:CPU
    its estimate is not lower at this size; on an H200 the GPT's is: BENCHMARKS section 14.)"""
    from keras_mp.jax.memory import abstract_copy

    with keras.RematScope(mode="list_of_layers", layer_names=["ffn_in"]):
        remat = _model()
    copy = abstract_copy(remat)
    assert copy.get_layer("ffn_in")._remat_mode.layer_names == ["ffn_in"]
    x = np.zeros((8, 32), "int32")
    kept = kmp.estimate_memory(_model(), x, policies="lean_bfloat16")["lean_bfloat16"]
    recomputed = kmp.estimate_memory(remat, x, policies="lean_bfloat16")["lean_bfloat16"]
    assert recomputed.weights_bytes == kept.weights_bytes
    assert recomputed.temp_bytes != kept.temp_bytes


def test_the_former_names_are_aliases():
    from keras_mp import fit

    assert kmp.FitReport is kmp.MemoryReport and fit.PolicyFit is kmp.memory_estimate.PolicyMemory
    with pytest.warns(DeprecationWarning, match="estimate_memory"):
        with pytest.raises(ValueError, match="`policies`"):  # same arguments, same checks
            kmp.will_it_fit(_model(), np.zeros((2, 32), "int32"), policies="float64")


# Run where `import jax` fails, as after `pip install keras_mp` without the jax extra.
_WITHOUT_JAX = """
import sys
sys.modules["jax"] = None
import json, os
import numpy as np
import keras
import keras_mp as kmp
from keras_mp.cli import main

inputs = keras.Input((4,))
model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
out = {"backend": keras.backend.backend()}
try:
    kmp.estimate_memory(model, np.zeros((2, 4), "float32"))
except Exception as error:
    out["library"] = [type(error).__name__, str(error), isinstance(error, ImportError)]
model.save(os.path.join(sys.argv[1], "m.keras"))
out["cli"] = main(["memory", os.path.join(sys.argv[1], "m.keras"), "--batch-size", "8"])
out["alias"] = main(["fit", os.path.join(sys.argv[1], "m.keras"), "--batch-size", "8"])
print(json.dumps(out))
"""


@pytest.mark.tf_only
def test_without_jax_the_estimate_says_what_to_install(tmp_path):
    """Issue 46: on TensorFlow without JAX, `will_it_fit` died of an IndexError (the JAX
    subprocess's exit status 1 read as "does not fit", its empty output then parsed) and
    `keras-mp fit` blamed a `--backend jax` nobody passed."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_JAX, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "KERAS_BACKEND": "tensorflow", "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    kind, message, is_import_error = out["library"]
    assert kind == "MissingExtraError" and is_import_error
    assert 'pip install "keras_mp[jax]"' in message and "estimate_memory" in message
    assert out["cli"] == 2 and out["alias"] == 2
    errors = [line for line in done.stderr.splitlines() if ": error:" in line]
    assert errors[0].startswith("keras-mp memory: error:")
    assert errors[1].startswith("keras-mp fit: error:")
    for line in errors:
        assert 'pip install "keras_mp[jax]"' in line and "--backend jax" not in line


def test_a_jax_subprocess_that_dies_is_an_error_not_a_report():
    from keras_mp.memory.memory_estimate import _subprocess_report

    died = subprocess.CompletedProcess([], 1, stdout="", stderr="Traceback\nOSError: boom\n")
    with pytest.raises(RuntimeError, match="exit status 1: OSError: boom"):
        _subprocess_report(died)
    noise = subprocess.CompletedProcess([], 1, stdout="a log line\n", stderr="")
    with pytest.raises(RuntimeError, match="a log line"):
        _subprocess_report(noise)
    row = {
        "policy": "float32", "peak_bytes": 10, "weights_bytes": 4, "optimizer_bytes": 4,
        "temp_bytes": 2, "fits": False, "error": None,
    }  # fmt: skip
    report = {
        "model": "m", "batch": [[2, 4]], "device": "cpu", "memory_bytes": 8,
        "headroom_bytes": 0, "exact": False, "rows": [row],
    }  # fmt: skip
    fits_not = subprocess.CompletedProcess([], 1, stdout=json.dumps(report) + "\n", stderr="")
    assert _subprocess_report(fits_not)["float32"].fits is False


@pytest.mark.slow  # three compiles of a keras_hub model: about 30 s alone, 100 s loaded
@jax_only
def test_estimate_memory_compiles_the_step_with_the_levers_asked():
    """`recompute="blocks"` sizes the step `kmp.recompute_blocks` makes (each decoder block
    of a tiny keras_hub Llama recomputed from its inputs), `fused_loss=True` the one
    `kmp.use_fused_loss` makes: other programs than the plain step's, the same weights and
    state; the report says which levers it was compiled with."""
    keras_hub = pytest.importorskip("keras_hub")
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=512,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=128,
    )
    task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    x = {"token_ids": np.zeros((2, 64), "int32"), "padding_mask": np.ones((2, 64), "int32")}
    y = np.zeros((2, 64), "int32")
    reports = {
        levers: kmp.estimate_memory(task, x, y, policies="lean_bfloat16", **dict(levers))
        for levers in ((), (("recompute", "blocks"),), (("fused_loss", True),))
    }
    rows = {levers: r["lean_bfloat16"] for levers, r in reports.items()}
    plain = rows[()]
    for levers, row in rows.items():
        assert row.error is None, (levers, row.error)
        assert row.weights_bytes == plain.weights_bytes
        assert row.optimizer_bytes == plain.optimizer_bytes
        if levers:
            assert row.temp_bytes != plain.temp_bytes, levers
    assert reports[(("recompute", "blocks"),)].recompute == "blocks"
    assert "with recompute='blocks'" in str(reports[(("recompute", "blocks"),)])
    assert "with fused_loss=True" in str(reports[(("fused_loss", True),)])
    with pytest.raises(ValueError, match=r"invalid `recompute`='all'; one of \['blocks'"):
        kmp.estimate_memory(task, x, y, recompute="all")
