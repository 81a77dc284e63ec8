"""A training process checkpointing every step, killed with SIGKILL at random moments.

`kmp.callbacks.ModelCheckpoint` must leave a complete `last.keras` after every kill, which
the next run loads with `kmp.saving.load_model` and resumes from (optimizer iterations and
loss scale as saved); stock `keras.callbacks.ModelCheckpoint` under the same kill loop
leaves a broken file (the counter-check that the kills land mid-write).
The children come from `tests/_checkpoint_kill_worker.py`: one process imports TensorFlow
once and forks a training child per kill.
"""

import os
import zipfile

import keras
import numpy as np
import pytest
from _worker_client import Worker

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork"), reason="the worker forks its training children (POSIX only)"
)
# Each forked child compiles its train step again: about 1 s a kill on TensorFlow, 8 s on
# JAX (its CPU compile), so on JAX the kill loops run with the slow tests.
slow_on_jax = pytest.mark.slow if keras.backend.backend() == "jax" else (lambda f: f)

WORKER = os.path.join(os.path.dirname(__file__), "_checkpoint_kill_worker.py")


@pytest.fixture
def worker(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    made = []

    def start(width=512):
        made.append(Worker(WORKER, run, width))
        return run, made[-1]

    yield start
    for w in made:
        w.close()


def _complete(path):
    """Whether `path` is a whole .keras archive (zip directory present, members' CRCs)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip() is None and "model.weights.h5" in archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


def _kill_loop(run, w, kills, seed):
    """Starts and kills `kills` children; returns (mid-write kills, first save's seconds)."""
    rng = np.random.default_rng(seed)
    mid_write, saves, before = 0, [], None
    for i in range(kills):
        w.send("run atomic")
        got = w.answer()
        resumed = got.get("resumed")
        if i == 0:
            assert got == {"fresh": True}
        else:
            # The file holds at least the checkpoint confirmed before the kill, and the
            # optimizer state came back with it.
            assert resumed["optimizer"] == "LossScaleOptimizer", resumed
            assert resumed["iterations"] >= before["saved"], (i, resumed, before)
            assert 1.0 <= resumed["scale"] <= 2.0**24, resumed
        before = w.answer()  # the child's first checkpoint is written
        if resumed is not None:
            assert before["saved"] == resumed["iterations"] + 1, (resumed, before)
        saves.append(before["save_s"])
        # Seeded delays spread over about three saves: most kills land inside a write.
        w.kill_child_after(before["child"], rng.uniform(0, 3 * before["save_s"]))
        mid_write += any(".tmp-" in name for name in os.listdir(run))
        assert _complete(run / "last.keras"), f"kill {i} left a broken last.keras"
    return mid_write, float(np.median(saves)), before


def _check_resume(run, w, before):
    w.send("check")
    resumed = w.answer()["resumed"]
    assert resumed["iterations"] >= before["saved"] and resumed["optimizer"] == "LossScaleOptimizer"
    w.answer()  # its checkpoint
    done = w.answer()["done"]
    assert done["iterations"] == resumed["iterations"] + 1, (resumed, done)
    w.send("wait")
    assert w.answer()["exit"] == 0
    # Every stale temporary file of the killed saves was removed by a later save.
    assert sorted(os.listdir(run)) == ["last.keras"], os.listdir(run)


@slow_on_jax
def test_sigkill_mid_checkpoint_always_leaves_a_loadable_file(worker):
    run, w = worker()
    mid_write, save_s, before = _kill_loop(run, w, kills=10, seed=0)
    # The kills hit the save window (a temporary file was left behind) at least once.
    assert mid_write >= 1, (mid_write, save_s)
    _check_resume(run, w, before)


@pytest.mark.slow
def test_sigkill_forty_times_with_a_bigger_model(worker):
    run, w = worker(width=1024)  # about 13 MB a checkpoint
    mid_write, save_s, before = _kill_loop(run, w, kills=40, seed=1)
    assert mid_write >= 10, (mid_write, save_s)
    _check_resume(run, w, before)


@slow_on_jax
def test_stock_model_checkpoint_breaks_under_the_same_kills(worker):
    """The counter-check: the same kills leave stock Keras' file broken."""
    run, w = worker()
    rng = np.random.default_rng(0)
    for _ in range(10):
        w.send("run stock")
        saved = w.answer()
        w.kill_child_after(saved["child"], rng.uniform(0, 3 * saved["save_s"]))
        if not _complete(run / "last.keras"):
            break
    else:
        pytest.fail("10 kills never left stock ModelCheckpoint's file broken")
