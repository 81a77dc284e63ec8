"""LossScaleOptimizer across devices: every replica skips together, state never drifts.

Device counts are fixed when TensorFlow / JAX start, so each scenario runs in its own
process (tests/_distribute_worker.py), once per module, and the tests here assert on the
JSON it prints. The data: 3 global batches of 8 rows; only the *second replica's* half
of batch 1 holds a NaN (checked below), so a replica deciding on its own gradients would
apply a step its peer skips: NaN weights under MirroredStrategy, a hang in the collective
under MultiWorkerMirroredStrategy. Expected on every replica: batch 1 skipped, the scale
16 -> 8 once, and the result equal to one device training on the same global batches.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_distribute_worker.py")
TIMEOUT_S = 300  # per worker process; each run takes ~10-40 s on 2 busy CPU cores
# The models compute in float16 (TF) / bfloat16 (JAX): the distributed and the
# single-device runs may round differently, by about one low-precision ulp of the update.
TOL = {"tensorflow": 1e-3, "jax": 2e-3}
STATE = ("step_counter", "dynamic_scale", "hysteresis_left", "skipped_steps",
         "last_overflow_step", "nonfinite_mask")


def _env():
    env = dict(os.environ)
    for name in ("KERAS_BACKEND", "XLA_FLAGS", "TF_CONFIG"):
        env.pop(name, None)
    return env


def _run(mode):
    proc = subprocess.run(
        [sys.executable, WORKER, mode], capture_output=True, text=True, timeout=TIMEOUT_S,
        env=_env(),
    )  # on timeout, subprocess.run kills the worker before raising
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _column(out, snapshot, suffix):
    """Value of the variable whose path ends with `suffix`, per replica."""
    (index,) = [i for i, n in enumerate(out["names"]) if n.endswith("/" + suffix)]
    return snapshot[index]


def _assert_replicas_identical(out, history):
    for step, snapshot in enumerate(history):
        for name, per_replica in zip(out["names"], snapshot):
            for other in per_replica[1:]:
                assert np.array_equal(per_replica[0], other), (step, name)


def _assert_skip_then_train(out, history):
    """Scale/counters after each of the 3 steps, and what the skipped step left alone."""
    scale = [_column(out, s, "dynamic_scale")[0] for s in history]
    skipped = [_column(out, s, "skipped_steps")[0] for s in history]
    last = [_column(out, s, "last_overflow_step")[0] for s in history]
    assert (scale, skipped, last) == ([16.0, 8.0, 8.0], [0, 1, 1], [-1, 1, 1])
    assert _column(out, history[1], "nonfinite_mask")[0] == [1, 1, 1, 1]
    training = [i for i, n in enumerate(out["names"]) if not n.endswith(STATE)]
    assert len(training) == 4 + 2 + 2 + 4  # weights, outer+inner iteration/lr, momenta
    for i in training:  # weights, momenta, iterations: untouched by the skipped step
        assert np.array_equal(history[0][i], history[1][i]), out["names"][i]
    moved = [i for i in training if not np.array_equal(history[1][i], history[2][i])]
    assert len(moved) >= 8, "step 2 should train (weights and momenta move)"


def _assert_matches(out, history, reference, tol):
    for name, per_replica, want in zip(out["names"], history[-1], reference):
        np.testing.assert_allclose(per_replica[0], want, atol=tol, rtol=tol, err_msg=name)


# -- MirroredStrategy, 2 logical CPUs ------------------------------------------------------


@pytest.fixture(scope="module")
def mirrored():
    return _run("mirrored")


@pytest.mark.tf_only
def test_mirrored_nan_reaches_only_the_second_replica(mirrored):
    assert mirrored["nan_in_shard"] == [[False, False], [False, True], [False, False]]


@pytest.mark.tf_only
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_mirrored_replicas_skip_together_and_match_one_device(mirrored, loop):
    history = mirrored[loop]
    assert all(len(per_replica) == 2 for per_replica in history[0])
    _assert_replicas_identical(mirrored, history)
    _assert_skip_then_train(mirrored, history)
    _assert_matches(mirrored, history, mirrored["reference"], TOL["tensorflow"])


@pytest.mark.tf_only
def test_mirrored_jit_compile_raises_before_running(mirrored):
    # model.fit(jit_compile=True) compiles the whole strategy.run; so does TF itself for a
    # compiled per-replica step on non-GPU devices (it lifts the tf.function around it).
    for error in (mirrored["fit_jit_error"], mirrored["custom_jit_error"]):
        assert "jit_compile=True is not supported under MirroredStrategy" in error
        assert "whole `strategy.run` is compiled" in error
        assert "jit_compile=False" in error  # says what to do
    after = mirrored["after_jit_error"]  # raised while tracing: nothing was written
    for name, per_replica, init in zip(mirrored["names"], after, mirrored["init"]):
        assert all(np.array_equal(v, init) for v in per_replica), name
    assert _column(mirrored, after, "dynamic_scale") == [16.0, 16.0]
    assert _column(mirrored, after, "skipped_steps") == [0, 0]


# -- MultiWorkerMirroredStrategy, 2 worker processes on 127.0.0.1 -------------------------


@pytest.fixture(scope="module")
def workers():
    from keras_mp.tf.distribute import launch_local_workers

    results = launch_local_workers(
        [sys.executable, WORKER, "multiworker"], num_workers=2, timeout=TIMEOUT_S, env=_env()
    )
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


@pytest.mark.tf_only
def test_multiworker_workers_skip_together_and_match_one_device(workers):
    assert [w["worker"] for w in workers] == [0, 1]
    assert [w["nan_in_shard"] for w in workers] == [[False] * 3, [False, True, False]]
    # One replica per worker: put both workers' values side by side and compare.
    w0, w1 = (w["custom"] for w in workers)
    joined = [[a + b for a, b in zip(s0, s1)] for s0, s1 in zip(w0, w1)]
    _assert_replicas_identical(workers[0], joined)
    _assert_skip_then_train(workers[0], joined)
    _assert_matches(workers[0], joined, workers[0]["reference"], TOL["tensorflow"])
    for w in workers:
        assert "no XLA cross-replica reduction on ['CPU']" in w["custom_jit_error"]


def test_launch_local_workers_kills_the_cluster_when_one_worker_fails():
    from keras_mp.tf.distribute import launch_local_workers

    code = (
        "import os, sys, time\n"
        "if os.environ['KERAS_MP_WORKER_INDEX'] == '1': sys.exit('worker 1 gives up')\n"
        "time.sleep(60)\n"  # worker 0 would wait for its peer forever
    )
    with pytest.raises(RuntimeError, match=r"cluster failed(.|\n)*worker 1 gives up"):
        launch_local_workers([sys.executable, "-c", code], num_workers=2, timeout=30)


def test_local_tf_configs():
    from keras_mp.tf.distribute import local_tf_configs

    configs = [json.loads(c) for c in local_tf_configs(3)]
    workers = configs[0]["cluster"]["worker"]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": i} for i in range(3)]
    assert all(c["cluster"]["worker"] == workers for c in configs)
    assert len(set(workers)) == 3 and all(w.startswith("127.0.0.1:") for w in workers)
    with pytest.raises(ValueError, match="`ports` must have one port per worker"):
        local_tf_configs(2, ports=[1234])
    with pytest.raises(ValueError, match="`num_workers` must be a positive integer"):
        local_tf_configs(0)


# -- JAX: keras.distribution over 2 host devices -------------------------------------------


@pytest.fixture(scope="module")
def jax_run():
    pytest.importorskip("jax")
    return _run("jax")


def test_jax_data_parallel_devices_skip_together(jax_run):
    history = jax_run["data_parallel"]
    assert jax_run["data_parallel_nan_in_shard"] == [False, True]
    assert all(len(shards) == 2 for shards in history[0])  # every variable on both devices
    _assert_replicas_identical(jax_run, history)
    _assert_skip_then_train(jax_run, history)
    single = [shards[0] for shards in jax_run["single"][-1]]
    _assert_matches(jax_run, history, single, TOL["jax"])


def test_jax_model_parallel_sharded_kernel_skips_with_the_rest(jax_run):
    history, single = jax_run["model_parallel"], jax_run["single"]
    (kernel,) = [i for i, n in enumerate(jax_run["names"]) if n.endswith("hidden/kernel")]
    assert [np.shape(s) for s in history[0][kernel]] == [(4, 2), (4, 2)]  # split, not copied
    # Sharded variables (the kernel and its momentum): glue the column halves back.
    split = [i for i, s in enumerate(single[0]) if np.shape(history[0][i][0]) != np.shape(s[0])]
    assert len(split) == 2, [jax_run["names"][i] for i in split]
    merged = [
        [[np.concatenate(s, axis=1).tolist()] if i in split else s for i, s in enumerate(snap)]
        for snap in history
    ]
    _assert_replicas_identical(jax_run, merged)
    _assert_skip_then_train(jax_run, merged)
    _assert_matches(jax_run, merged, [shards[0] for shards in single[-1]], TOL["jax"])


# -- the example -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.tf_only
def test_multi_device_example_workers_agree():
    example = os.path.join(os.path.dirname(WORKER), os.pardir, "examples", "multi_device.py")
    proc = subprocess.run(
        [sys.executable, example], capture_output=True, text=True, timeout=600,
        env=dict(_env(), KERAS_MP_EXAMPLE_FAST="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "workers agree bit for bit" in proc.stdout
    skipped = re.findall(r"(\d+) skipped", proc.stdout)
    assert len(skipped) == 2 and int(skipped[0]) > 0  # the high initial scale overflowed
