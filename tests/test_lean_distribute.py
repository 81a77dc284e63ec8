"""The lean state on several devices and processes (issue 32).

Each scenario runs in its own process(es) (tests/_lean_distribute_worker.py: device counts
are fixed when TensorFlow / JAX start), once per suite (marked tf_only: the workers pick
their own backend). The same model (LayerNormalizations and Dense layers: several
variables of one shape) trains on the same global batches as on one device.

- TensorFlow: MirroredStrategy on 2 logical CPUs and MultiWorkerMirroredStrategy with 2
  local worker processes (whose collective broadcast takes no bfloat16 or uint8 without
  `keras_mp.tf.distribute.widen_collective_broadcasts`).
- JAX, 4 virtual devices: DataParallel, DataParallel with the state split over the data
  axis (`shard_over_data`, ZeRO-1), ModelParallel (the state sharded like the kernels),
  a 2 x 2 mesh with both; and 2 processes on 127.0.0.1 with 2 devices each.

Tolerance: replicas sum bfloat16 gradients in another order than one device, so weights
differ by a small fraction of how far training moved them; the test holds lean to the
fraction mixed_bfloat16 shows on the same devices (x3, or 1% of the movement; at most 3%):
the 8-bit blocks of a sharded state differ from one device's, and stochastic rounding
turns a one-ulp difference into another draw.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from keras_mp.tf.distribute import launch_local_workers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_lean_distribute_worker.py")
TIMEOUT_S = 300
pytestmark = pytest.mark.tf_only


def _env():
    env = dict(os.environ)
    for name in ("KERAS_BACKEND", "XLA_FLAGS", "TF_CONFIG"):
        env.pop(name, None)
    return env


def _run(*args):
    proc = subprocess.run(
        [sys.executable, WORKER, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _relative_gap(weights, reference, init):
    """Mean |weights - reference| over mean |reference - init|."""
    gap = np.mean([np.abs(np.array(a) - np.array(b)).mean() for a, b in zip(weights, reference)])
    moved = np.mean([np.abs(np.array(b) - np.array(c)).mean() for b, c in zip(reference, init)])
    assert moved > 0
    return gap / moved


def _assert_close(lean_gap, mixed_gap):
    assert lean_gap <= max(3 * mixed_gap, 0.01) and lean_gap < 0.03, (lean_gap, mixed_gap)


# -- TensorFlow ---------------------------------------------------------------------------


@pytest.mark.slow
def test_mirrored_two_replicas_match_one_device():
    out = _run("mirrored")
    gaps = {}
    for policy, entry in out.items():
        assert entry["replicas"] == 2 and entry["replicas_agree"], policy
        gaps[policy] = _relative_gap(entry["distributed"], entry["single"], entry["init"])
    _assert_close(gaps["lean_bfloat16"], gaps["mixed_bfloat16"])


@pytest.fixture(scope="module")
def multiworker():
    results = launch_local_workers(
        [sys.executable, WORKER, "multiworker"], num_workers=2, timeout=TIMEOUT_S, env=_env()
    )
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in results]


def test_multiworker_trains_lean_bit_identical_across_workers(multiworker):
    chief, other = multiworker
    lean = chief["lean_bfloat16"]
    assert {"bfloat16", "uint8", "int8"} <= set(lean["dtypes"])  # what the broadcast refused
    # The second worker drew other initial values; the broadcast made them the chief's.
    for policy in ("lean_bfloat16", "mixed_bfloat16"):
        for key in ("init", "weights", "state"):
            for a, b in zip(chief[policy][key], other[policy][key]):
                np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=(policy, key))
    gaps = {
        p: _relative_gap(chief[p]["weights"], chief[p]["single"], chief[p]["init"])
        for p in ("lean_bfloat16", "mixed_bfloat16")
    }
    _assert_close(gaps["lean_bfloat16"], gaps["mixed_bfloat16"])


# -- JAX ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_devices():
    return _run("jax")


@pytest.mark.slow  # CI time (2026-12-06): runs with -m slow
def test_jax_lean_state_is_placed_like_the_weights(jax_devices):
    single = jax_devices["single"]
    assert single["devices"] == 1 and 2.9 < single["state_bytes"] < 3.2
    # DataParallel replicates weights and state (stock AdamW's state too).
    assert jax_devices["data_parallel"]["state_bytes"] == pytest.approx(single["state_bytes"])
    # ModelParallel: the compensation and moment codes take the kernels' layout; only the
    # norms and the unsharded biases (a few % of the parameters) stay whole everywhere.
    mp, mixed_mp = jax_devices["model_parallel"], jax_devices["mixed_model_parallel"]
    assert mp["devices"] == 4
    assert mp["state_bytes"] <= 3 / 4 + 0.1, mp["state_bytes"]
    assert mp["weight_bytes"] + mp["state_bytes"] < 0.45 * (
        mixed_mp["weight_bytes"] + mixed_mp["state_bytes"]
    )


@pytest.mark.slow  # CI time (2026-12-06): runs with -m slow
def test_jax_shard_over_data_splits_the_state(jax_devices):
    for name in ("data_parallel_split", "model_parallel_2x2_split"):
        entry = jax_devices[name]
        assert entry["devices"] == 4 and entry["state_bytes"] <= 3 / 4 + 0.1, (name, entry)
    # The weights stay where the distribution puts them: whole under DataParallel.
    assert jax_devices["data_parallel_split"]["weight_bytes"] == 2.0


@pytest.mark.slow  # CI time (2026-12-06): runs with -m slow
def test_jax_distributed_lean_matches_one_device(jax_devices):
    single, mixed = jax_devices["single"], jax_devices["mixed_single"]
    for name, mixed_name in [
        ("data_parallel", "mixed_data_parallel"),
        ("data_parallel_split", "mixed_data_parallel"),
        ("model_parallel", "mixed_model_parallel"),
        ("model_parallel_2x2_split", "mixed_model_parallel"),
    ]:
        lean_gap = _relative_gap(jax_devices[name]["weights"], single["weights"], single["init"])
        mixed_gap = _relative_gap(
            jax_devices[mixed_name]["weights"], mixed["weights"], mixed["init"]
        )
        _assert_close(lean_gap, mixed_gap)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # CI time (2026-12-06): runs with -m slow
def test_jax_two_processes_train_lean_bit_identical(jax_devices):
    port = str(_free_port())
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(2)]
    procs = [  # files, not pipes: a process blocked on a full pipe would stall its peer
        subprocess.Popen(
            [sys.executable, WORKER, "jax_process", str(i), port],
            stdout=out, stderr=err, text=True, env=_env(),
        )
        for i, (out, err) in enumerate(logs)
    ]
    outs = []
    try:
        for p, (out, err) in zip(procs, logs):
            p.wait(timeout=TIMEOUT_S)
            out.seek(0), err.seek(0)
            assert p.returncode == 0, err.read()[-4000:]
            outs.append(json.loads(out.read().strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    first, second = outs
    single = jax_devices["single"]  # the same model and batches on one device
    for name in ("data_parallel_split", "model_parallel_split"):
        a, b = first[name], second[name]
        assert a["devices"] == b["devices"] == 2  # the devices each process holds
        for x, y in zip(a["weights"], b["weights"]):
            np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=name)
        assert a["state_bytes"] <= 3 / 4 + 0.1, (name, a["state_bytes"])
        assert _relative_gap(a["weights"], single["weights"], single["init"]) < 0.03
