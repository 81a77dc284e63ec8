"""Run fingerprints (`kmp.fingerprint`), their diff, `keras-mp diff`, and the deterministic mode.

The training runs are real: a small MLP under mixed_float16 (TensorFlow; mixed_bfloat16 on
JAX, whose CPU has no float16 dot) with `kmp.LossScaleOptimizer(Adam)`, 12 steps of 32
rows, a record every step (tests/_fingerprint_worker.py). oneDNN on/off and
MirroredStrategy need their own processes.
"""

import json
import os
import subprocess
import sys

import _fingerprint_worker as worker
import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp import fingerprint
from keras_mp.hardware.determinism import XLA_DETERMINISM_FLAGS

BACKEND = keras.backend.backend()
POLICY = "mixed_float16" if BACKEND == "tensorflow" else "mixed_bfloat16"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fingerprint_worker.py")


def _train(path, **kwargs):
    # TensorFlow: without XLA by default (compiling costs more than these 12 steps).
    kwargs.setdefault("jit_compile", BACKEND != "tensorflow")
    return worker.train(str(path), policy=POLICY, **kwargs)


def _worker(*args, env=None):
    environ = dict(os.environ)
    for name in ("KERAS_BACKEND", "XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS"):
        environ.pop(name, None)
    return subprocess.Popen(
        [sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> fingerprint path of the in-process runs; on TensorFlow, the oneDNN-off and
    oneDNN-on + MirroredStrategy runs start first, in their own processes (`procs`)."""
    d = tmp_path_factory.mktemp("fp")
    out = {"dir": d, "procs": []}
    if BACKEND == "tensorflow":
        out["procs"] = [
            _worker("onednn", str(d / "onednn0.json"), env={"TF_ENABLE_ONEDNN_OPTS": "0"}),
            _worker("onednn+mirrored", str(d), env={"TF_ENABLE_ONEDNN_OPTS": "1"}),
        ]
    variants = {
        "base": {}, "nan_a": {"nan": 6}, "nan_b": {"nan": 6},
        "lr": {"lr": 2e-3, "every": 4}, "swap": {"swap": 7},
    }
    if BACKEND == "tensorflow":
        variants["xla"] = {"jit_compile": True}
    for name, kwargs in variants.items():
        out[name] = str(d / f"{name}.json")
        _train(out[name], **kwargs)
        keras.backend.clear_session(free_memory=False)
    yield out
    for proc in out["procs"]:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def subprocess_runs(runs):
    """The directory of the oneDNN and MirroredStrategy fingerprints (TF only)."""
    for proc in runs["procs"]:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
    return runs["dir"]


# -- the runs the issue asks for ------------------------------------------------------------


def test_two_runs_with_a_nan_batch_are_identical_and_record_the_skip(runs):
    report = fingerprint.diff(runs["nan_a"], runs["nan_b"])
    assert report.verdict == "identical", str(report)
    a, b = fingerprint.load(runs["nan_a"]), fingerprint.load(runs["nan_b"])
    assert a["records"] == b["records"]  # bit for bit (paths differ: two models in a process)
    rec6 = a["records"][6]
    assert rec6["step"] == 6 and rec6["skipped_steps"] == [6] and rec6["skipped"] == 1
    assert rec6["loss"] is None and rec6["vars"] == a["records"][5]["vars"]
    assert a["records"][5]["scale"] == 2 * rec6["scale"]


def test_a_nan_batch_in_one_run_only_diverges_at_that_step(runs):
    report = fingerprint.diff(runs["base"], runs["nan_a"])
    assert (report.verdict, report.step) == ("diverged", 6), str(report)
    assert "skipped in B only" in report.cause
    assert any("loss-scale path split" in e for e in report.evidence)


@pytest.mark.tf_only
def test_xla_on_and_off_differ_by_rounding_only(runs):
    report = fingerprint.diff(runs["xla"], runs["base"])
    assert report.verdict == "rounding", str(report)
    assert 0 < report.distance < report.bound
    assert any(c.startswith("jit_compile") for c in report.context)
    assert "rounding: same trajectory" in str(report)


def test_a_different_learning_rate_diverges_at_the_first_record(runs):
    report = fingerprint.diff(runs["base"], runs["lr"])
    assert report.verdict == "diverged", str(report)
    assert report.step == 1 and report.record_step == 4  # the loss of step 2 shows it
    assert "learning_rate" in report.cause
    assert report.variable.endswith("hidden1/kernel")
    assert report.distance > report.bound


def test_one_swapped_batch_diverges_at_its_step_naming_the_first_variable(runs):
    report = fingerprint.diff(runs["base"], runs["swap"])
    assert (report.verdict, report.step, report.record_step) == ("diverged", 7, 7), str(report)
    assert report.variable.endswith("hidden1/kernel")
    assert "the batch of step 7 differs" in report.cause
    assert report.loss_step == 7


@pytest.mark.tf_only
def test_onednn_on_and_off_differ_by_rounding_only(subprocess_runs):
    d = subprocess_runs
    report = fingerprint.diff(d / "onednn0.json", d / "onednn1.json")
    assert any("TF_ENABLE_ONEDNN_OPTS" in c for c in report.context)
    if report.verdict == "identical":  # a CPU without AVX512-BF16: oneDNN changes nothing
        pytest.skip("oneDNN made no difference to this model on this CPU")
    assert report.verdict == "rounding", str(report)
    assert 0 < report.distance < report.bound


@pytest.mark.tf_only
def test_mirrored_one_replica_shard_differs(subprocess_runs):
    d = subprocess_runs
    assert fingerprint.diff(d / "a.json", d / "c.json").verdict == "identical"
    report = fingerprint.diff(d / "a.json", d / "b.json")
    assert (report.verdict, report.step) == ("diverged", 5), str(report)
    assert report.variable.endswith("hidden1/kernel")
    assert "the batch of step 5 differs" in report.cause
    meta = fingerprint.load(d / "a.json")["meta"]
    assert meta["replicas"] == 2
    assert all("replica_drift" not in r for r in fingerprint.load(d / "b.json")["records"])


# -- the command line -----------------------------------------------------------------------


def _cli(capsys, *args):
    from keras_mp.cli.main import main

    status = main(["diff", *map(str, args)])
    return status, capsys.readouterr()


def test_cli_diff_exit_status(runs, capsys):
    status, out = _cli(capsys, runs["nan_a"], runs["nan_b"])
    assert status == 0 and out.out.startswith("identical")
    status, out = _cli(capsys, runs["base"], runs["swap"])
    assert status == 1 and out.out.startswith("diverged at step 7")
    status, out = _cli(capsys, runs["base"], runs["swap"], "--json")
    assert status == 1 and json.loads(out.out)["step"] == 7


def test_cli_diff_bad_input_is_one_line_and_status_2(runs, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text(open(runs["base"]).read()[:500])
    other = json.load(open(runs["base"]))
    other["variables"][0]["shape"] = [3, 3]
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    not_fp = tmp_path / "not.json"
    not_fp.write_text("[1, 2]")
    cases = {
        "missing": (tmp_path / "missing.json", "no such fingerprint file"),
        "corrupt": (corrupt, "not valid JSON"),
        "other model": (other_path, "fingerprints of different models"),
        "not a fingerprint": (not_fp, "not a keras_mp fingerprint"),
        "directory": (tmp_path, "is a directory"),
    }
    for name, (path, message) in cases.items():
        status, out = _cli(capsys, runs["base"], path)
        assert status == 2, name
        assert out.err.count("\n") == 1 and out.err.startswith("keras-mp diff: error:"), out.err
        assert message in out.err, (name, out.err)


# -- recording ------------------------------------------------------------------------------


def test_recorder_in_a_custom_loop(tmp_path):
    keras.config.set_dtype_policy(POLICY)
    x, y = worker.data(6)

    def loop(optimizer):
        keras.utils.set_random_seed(1)
        model = worker.build(keras, kmp)[0]
        model.compile(optimizer=optimizer, loss=kmp.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        rec = fingerprint.Recorder(model, every_n_steps=2)
        for i in range(6):
            loss = model.train_on_batch(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
            rec.step(loss)
        return rec

    a = loop(kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)))
    b = loop(kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)))
    assert [r["step"] for r in a.records] == [0, 2, 4, 6]
    assert len(a.records[-1]["losses"]) == 2 and a.records[-1]["loss"] > 0
    assert a.records[-1]["scale"] == 2.0**15 and a.records[-1]["skipped"] == 0
    assert fingerprint.diff(a, b).verdict == "identical"
    path = a.save(tmp_path / "custom.json")
    assert fingerprint.diff(path, b).verdict == "identical"
    keras.config.set_dtype_policy("float32")
    plain = loop(keras.optimizers.SGD(0.1))  # no loss scaling: no scale, no skip tracking
    assert plain.records[-1]["scale"] is None and plain.records[-1]["skipped"] is None


@pytest.mark.skipif(BACKEND != "jax", reason="a stateless JAX loop")
def test_recorder_with_a_stateless_jax_loop():
    import jax

    def run():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        opt.build(model.trainable_variables)
        rec = fingerprint.Recorder(model, optimizer=opt, every_n_steps=3)
        state = tuple([v.value for v in vs] for vs in (
            model.trainable_variables, model.non_trainable_variables, opt.variables))

        @jax.jit
        def step(state, x, y):
            tv, ntv, ov = state

            def loss_fn(tv):  # the loss scaled as docs/custom-training.md's JAX loop does
                out, ntv2 = model.stateless_call(tv, ntv, x, training=True)
                loss = keras.ops.mean((out - y) ** 2)
                with keras.StatelessScope(state_mapping=list(zip(opt.variables, ov))):
                    scaled = opt.scale_loss(loss)
                return scaled, (loss, ntv2)

            (_, (loss, ntv2)), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv)
            tv2, ov2 = opt.stateless_apply(ov, grads, tv)
            return (tv2, ntv2, ov2), loss

        rng = np.random.default_rng(0)
        for i in range(9):
            x, y = rng.normal(size=(16, 8)), rng.normal(size=(16, 1))
            if i == 4:
                x[0, 0] = np.nan
            state, loss = step(state, x, y)
            rec.step(loss, state=state)  # the values after the step; the variables are stale
        return rec

    a, b = run(), run()
    assert [(r["step"], r["skipped_steps"]) for r in a.records] == [(0, []), (3, []), (6, [5]),
                                                                      (9, [])]
    assert a.records[2]["scale"] == 2.0**14  # the initial 2**15, halved by the NaN step
    assert a.records[3]["vars"] != a.records[0]["vars"]
    assert fingerprint.diff(a, b).verdict == "identical"


def test_steps_without_a_record_read_nothing_from_the_device():
    model = worker.build(keras, kmp)[0]
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam())
    opt.build(model.trainable_variables)
    rec = fingerprint.Recorder(model, optimizer=opt, every_n_steps=10)
    loss = keras.ops.convert_to_tensor(1.5)
    assert rec.step(loss) is None
    _, _, pending_loss, snapshot = rec._pending[-1]
    assert not isinstance(pending_loss, (float, np.ndarray))
    assert not isinstance(snapshot, np.ndarray)  # an on-device copy of `iterations`


def test_a_million_parameter_model_stays_small(tmp_path):
    model = keras.Sequential([
        keras.Input((1000,)), keras.layers.Dense(1000), keras.layers.Dense(10),
    ])  # 1.01M parameters
    rec = fingerprint.Recorder(model, optimizer=keras.optimizers.Adam(), every_n_steps=100)
    for _ in range(1000):
        rec.step(1.0)
    size = os.path.getsize(rec.save(tmp_path / "big.json"))
    per_record = size / len(rec.records)
    assert len(rec.records) == 11 and per_record < 2000, per_record
    # 100 records (10,000 steps every 100) of a 1M-parameter model: well under 1 MB
    assert 100 * per_record + 1000 * 12 < 1e6


def test_summarize_sketch_estimates_the_distance():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 200)).astype("float32")
    h, mean, rms, maxabs, sketch = fingerprint.summarize(w)
    assert len(h) == 16 and len(sketch) == 8
    assert (mean, rms, maxabs) == pytest.approx(
        (w.mean(dtype="float64"), np.sqrt(np.mean(w.astype("float64") ** 2)), np.abs(w).max()),
        rel=1e-7,
    )
    sparse = w.copy()
    sparse[17, 3] += 0.5  # one element: the sketch distance is exact
    d = np.linalg.norm(np.subtract(fingerprint.summarize(sparse)[4], sketch))
    assert d == pytest.approx(0.5, rel=1e-6)
    dense = w + 1e-3 * rng.normal(size=w.shape).astype("float32")
    d = np.linalg.norm(np.subtract(fingerprint.summarize(dense)[4], sketch))
    assert 0.4 < d / np.linalg.norm((dense - w).astype("float64")) < 2.0
    assert fingerprint.summarize(w)[0] == h and fingerprint.summarize(dense)[0] != h


# -- the classification, on synthetic fingerprints ----------------------------------------------


def _synthetic(steps=6, seed=0, **change):
    """Two 2-variable runs as dicts: weights random-walk, loss decreasing with noise."""
    rng = np.random.default_rng(seed)
    walk = np.cumsum(rng.normal(size=(steps + 1, 2, 8)), axis=0)
    losses = 2.0 - 0.1 * np.arange(steps + 1) + 0.05 * rng.normal(size=steps + 1)
    records = []
    for k in range(steps + 1):
        sk = walk[k].copy()
        if "init" in change:
            sk += 1.0
        if change.get("shift") is not None and k >= change["shift"]:
            sk[0] += 3.0
        loss = float(losses[k]) + (0.3 if change.get("loss_at") == k else 0.0)
        records.append({
            "step": k, "loss": None if k == 0 else loss, "losses": [] if k == 0 else [loss],
            "scale": 2.0**15 if change.get("scale_at") == k else 2.0**16, "skipped": 0,
            "skipped_steps": [], "optimizer_hash": "0",
            "vars": [[str(sk[i].tolist()), 0.0, 1.0, 1.0, sk[i].tolist()] for i in range(2)],
        })
        if change.get("drift_at") == k:
            records[-1]["replica_drift"] = [1]
    return {
        "format": "keras_mp.fingerprint", "version": 1,
        "meta": {"sketch_size": 8, "compute_dtypes": ["float16"], "optimizer": {"lr": 1}},
        "variables": [{"path": "w", "dtype": "float32", "shape": [100]},
                      {"path": "b", "dtype": "float32", "shape": [10]}],
        "records": records,
    }


@pytest.mark.parametrize("change, step, cause", [
    ({"init": 1}, 0, "different initial weights"),
    ({"loss_at": 1, "shift": 1}, 1, "different first batch"),
    ({"loss_at": 4, "shift": 4}, 4, "the batch of step 4 differs"),
    ({"scale_at": 3}, 3, "loss-scale path split"),
    ({"drift_at": 2}, 2, "a replica drifted"),
    ({"shift": 5}, 5, "differs while the losses agree"),
])
def test_causes(change, step, cause):
    report = fingerprint.diff(_synthetic(), _synthetic(**change))
    assert (report.verdict, report.step) == ("diverged", step), str(report)
    assert cause in report.cause, report.cause


def test_different_settings_are_never_rounding():
    a, b = _synthetic(), _synthetic()
    b["meta"]["optimizer"] = {"lr": 2}
    b["records"][3]["vars"][1][0] = "different"
    report = fingerprint.diff(a, b)
    assert (report.verdict, report.step) == ("diverged", 3)
    assert "optimizer.lr: 1 vs 2" in report.cause


def test_diff_errors():
    a = _synthetic()
    b = _synthetic()
    b["records"] = [dict(r, step=r["step"] + 100) for r in b["records"]]
    with pytest.raises(fingerprint.FingerprintError, match="no step recorded in both"):
        fingerprint.diff(a, b)
    b = _synthetic()
    b["variables"] = b["variables"][:1]
    with pytest.raises(fingerprint.FingerprintError, match="malformed record|different models"):
        fingerprint.diff(a, b)
    with pytest.raises(fingerprint.FingerprintError, match="no such file"):
        fingerprint.load("does/not/exist.json")


# -- the deterministic mode ------------------------------------------------------------------


def test_set_deterministic_reports_what_it_set_and_what_it_cannot(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    keras.ops.convert_to_numpy(keras.ops.ones(1) + 1)  # the backend has started
    try:
        report = kmp.hardware.set_deterministic(7)
        flags = os.environ["XLA_FLAGS"].split()
        assert flags[0] == "--xla_cpu_enable_fast_math=false"
        assert set(XLA_DETERMINISM_FLAGS) <= set(flags)
        assert "--xla_gpu_deterministic_ops=true" in flags
        assert os.environ["PYTHONHASHSEED"] == "7"
        text = str(report)
        assert report.seed == 7 and "no GPU here" in text
        assert any("set_random_seed" in a for a in report.applied)
        if BACKEND == "tensorflow":
            from tensorflow.python.framework import config

            assert config.is_op_determinism_enabled()
            assert any("oneDNN" in c for c in report.caveats) and report.costs
        else:  # JAX started long before this test: its XLA read XLA_FLAGS already
            assert any("JAX had already started" in t for t in report.too_late)
        assert kmp.hardware.set_deterministic(7).applied[0].endswith("(already there)")
        assert json.dumps(report.to_dict())
        with pytest.raises(ValueError, match="seed"):
            kmp.hardware.set_deterministic(-1)
    finally:
        if "tensorflow" in sys.modules:
            from tensorflow.python.framework import config

            config.disable_op_determinism()
