"""`kmp.callbacks.BackupAndRestore` under real SIGKILLs in the middle of epochs.

A run of 3 epochs of 8 shuffled batches, backed up every 3 batches, is killed twice in a
row in the middle of an epoch (once while a backup is being written), restarted with the
same `fit` arguments each time, and compared with a run never interrupted: the same
batches trained, once each, in the same order (counted and digested inside the model),
and the same weights and optimizer state (loss scale, its counters, skip count; the lean
moments) bit for bit. The counter-check runs Keras' own `BackupAndRestore` through the
same kills: it trains the interrupted epoch's first batches again.
The children come from `tests/_resume_kill_worker.py` (one process imports the backend
once and forks a child per run).
"""

import os

import numpy as np
import pytest
from _worker_client import Worker

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork"), reason="the worker forks its training children (POSIX only)"
)
WORKER = os.path.join(os.path.dirname(__file__), "_resume_kill_worker.py")
BATCHES = 3 * 8  # epochs x batches an epoch


@pytest.fixture
def worker(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    made = []

    def start(policy):
        made.append(Worker(WORKER, run, policy))
        return run, made[-1]

    yield start
    for w in made:
        w.close()


def _finish(w, name, kill="none", callback=""):
    w.send(f"run {name} {kill} {callback}")
    done = w.answer()["done"]
    w.send("wait")
    assert w.answer()["exit"] == 0
    return done


def _killed(w, name, kill, callback=""):
    w.send(f"run {name} {kill} {callback}")
    w.wait_killed()


def _final(run, name):
    with np.load(run / name / "final.npz") as f:
        return [f[k] for k in sorted(f.files)]


def _resume_twice(policy, worker):
    run, w = worker(policy)
    reference = _finish(w, "reference")
    assert reference["count"] == reference["trained_here"] == BATCHES, reference
    if policy == "mixed_float16":  # the scale started too high: it backed off, then grew
        assert reference["skipped"] > 0, reference
    # Backups after batches 3, 6, 9, ... (3 a backup, 8 an epoch). Killed while writing
    # the backup of batch 9 (epoch 1, batch 1): the backup of batch 6 (epoch 0, batch 6)
    # is the one left.
    _killed(w, "cut", "write:9")
    backup = run / "cut" / "backup"
    assert any(".tmp-" in name for name in os.listdir(backup)), os.listdir(backup)
    # Resumed at epoch 0, batch 6; killed after batch 14, its backup of batch 12 (epoch 1,
    # batch 4) done.
    _killed(w, "cut", "between:14")
    done = _finish(w, "cut")
    assert done["resumed_at"] == [1, 4], done
    assert done["trained_here"] == BATCHES - 12, done  # nothing before the backup again
    # The final model trained every batch once, in the uninterrupted run's order ...
    assert (done["count"], done["digest"]) == (reference["count"], reference["digest"])
    # ... and the resumed epoch's logs average over all its batches, as the reference's.
    assert done["loss"] == reference["loss"][1:], (done["loss"], reference["loss"])
    got, want = _final(run, "cut"), _final(run, "reference")
    different = [
        p
        for p, a, b in zip(done["paths"], got, want)
        if a.dtype != b.dtype or a.tobytes() != b.tobytes()
    ]
    assert not different, f"not bit-identical to the uninterrupted run: {different}"
    assert sorted(os.listdir(backup)) == ["latest.weights.h5"], os.listdir(backup)


def test_two_kills_mid_epoch_resume_bit_identical_mixed_float16(worker):
    _resume_twice("mixed_float16", worker)


@pytest.mark.slow
def test_two_kills_mid_epoch_resume_bit_identical_lean_bfloat16(worker):
    _resume_twice("lean_bfloat16", worker)


@pytest.mark.slow
@pytest.mark.slow  # CI time (2026-12-06): Keras' own callback, shown; ours is tested above
def test_keras_backup_and_restore_repeats_batches_under_the_same_kills(worker):
    """The counter-check: Keras' own callback resumes at the epoch's first batch."""
    run, w = worker("mixed_float16")
    reference = _finish(w, "reference")
    _killed(w, "stock", "between:14", "stock")
    done = _finish(w, "stock", "none", "stock")
    # Backed up at batch 12 (epoch 1, batch 4), it trains epoch 1's first 4 batches again.
    assert done["count"] == reference["count"] + 4, (done, reference)
