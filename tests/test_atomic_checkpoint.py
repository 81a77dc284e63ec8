"""Atomic saving (`kmp.saving.save_model` / `save_weights`, `kmp.callbacks.ModelCheckpoint`).

A write goes to a temporary file and replaces the destination with `os.replace`, so the
old file is never written over in place: a hard link to it keeps the old bytes. A save that
fails part-way leaves the old file as it was and no temporary file. The kill test (a
process killed mid-save) is tests/test_checkpoint_kill.py.
"""

import errno
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp import atomic
from keras_mp.observe.checkpoint import ModelCheckpoint


def _data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _model(initial_scale=2.0**15):
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    model = kmp.convert(model, "mixed_float16")
    opt = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=initial_scale)
    model.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _optimizer_state(model):
    """(name, value) of every optimizer variable, in order (slot names follow layer names,
    which a loaded model may number differently)."""
    return [(v.name, keras.ops.convert_to_numpy(v.value)) for v in model.optimizer.variables]


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class FailingDense(keras.layers.Dense):
    """A Dense layer whose weights cannot be written: saving fails half-way."""

    def save_own_variables(self, store):
        raise OSError("No space left on device (simulated)")


def _leftovers(directory):
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n)


def test_save_model_replaces_the_file_instead_of_rewriting_it(tmp_path):
    model = _model()
    x, y = _data()
    path = tmp_path / "last.keras"
    kmp.saving.save_model(model, path)
    os.link(path, tmp_path / "old.keras")  # the same inode as the first save
    old = (tmp_path / "old.keras").read_bytes()
    model.fit(x, y, epochs=1, verbose=0)
    kmp.saving.save_model(model, path)
    # Keras' in-place write would have changed the linked file too.
    assert (tmp_path / "old.keras").read_bytes() == old
    assert path.read_bytes() != old
    assert _leftovers(tmp_path) == []
    loaded = kmp.saving.load_model(path)
    np.testing.assert_array_equal(loaded.layers[0].kernel.numpy(), model.layers[0].kernel.numpy())


def test_a_save_failing_half_way_keeps_the_old_file(tmp_path):
    model = _model()
    path = tmp_path / "last.keras"
    kmp.saving.save_model(model, path)
    before = path.read_bytes()
    broken = keras.Sequential([keras.Input((8,)), FailingDense(4)])
    with pytest.raises(OSError, match="No space left"):
        kmp.saving.save_model(broken, path)
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []
    # Stock Keras under the same failure: the previous checkpoint is gone.
    with pytest.raises(OSError, match="No space left"):
        broken.save(path)
    assert path.read_bytes() != before
    with pytest.raises(ValueError, match="model.weights"):  # a zip without the weights
        kmp.saving.load_model(path)


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path):
    path = tmp_path / "last.keras"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = atomic._host()
    stale = tmp_path / f".last.keras.tmp-{host}-{dead.pid}-0123abcd.keras"
    alive = tmp_path / f".last.keras.tmp-{host}-{os.getpid()}-0123abcd.keras"
    other_host = tmp_path / f".last.keras.tmp-{host}x-{dead.pid}-0123abcd.keras"
    for p in (stale, alive, other_host):
        p.write_bytes(b"PK half a zip")
    kmp.saving.save_model(_model(), path)
    assert not stale.exists()
    assert alive.exists() and other_host.exists()  # a running writer's file is left alone
    assert kmp.saving.load_model(path, compile=False).count_params() == 8 * 16 + 16 + 16 * 3 + 3


def test_temp_path_keeps_the_extension_keras_checks():
    assert atomic.temp_path("run/last.keras").endswith(".keras")
    assert atomic.temp_path("run/w.weights.h5").endswith(".weights.h5")
    assert os.path.basename(atomic.temp_path("run/w.weights.h5")).startswith(".w.weights.h5.tmp-")
    assert os.path.dirname(atomic.temp_path("run/last.keras")) == "run"


def test_bad_destinations_raise_clear_errors(tmp_path):
    model = _model()
    path = tmp_path / "m.keras"
    kmp.saving.save_model(model, path)
    with pytest.raises(FileExistsError, match="overwrite=False"):
        kmp.saving.save_model(model, path, overwrite=False)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        kmp.saving.save_model(model, tmp_path)
    with pytest.raises(ValueError, match=r"must end in `\.weights\.h5`"):
        kmp.saving.save_weights(model, tmp_path / "w.h5")
    assert _leftovers(tmp_path) == []


def test_resume_restores_the_loss_scale_state_and_continues_identically(tmp_path):
    # 2**24 overflows float16 gradients: the scale backs off and steps are skipped, so
    # the loss-scale state is far from its initial values.
    model = _model(initial_scale=2.0**24)
    x, y = _data()
    ckpt = kmp.callbacks.ModelCheckpoint(str(tmp_path / "last.keras"), save_freq=1)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[ckpt])
    saved = _optimizer_state(model)
    assert int(model.optimizer.skipped_steps.numpy()) > 0
    assert float(keras.ops.convert_to_numpy(model.optimizer.loss_scale)) < 2.0**24
    loaded = kmp.saving.load_model(tmp_path / "last.keras")
    assert type(loaded.optimizer) is kmp.LossScaleOptimizer
    restored = _optimizer_state(loaded)
    assert len(restored) == len(saved) > 10
    for (name, value), (loaded_name, loaded_value) in zip(saved, restored):
        if "dense" not in name:  # the iterations, the loss scale and its counters
            assert loaded_name == name
        np.testing.assert_array_equal(loaded_value, value, err_msg=name)
    # One more step from each: the same weights (the resumed run continues the saved one;
    # an Adam restarted from zero moments would be ~1e-3 off, the learning rate).
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    loaded.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=a.path)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())


def test_model_checkpoint_weights_only_best_only_and_epoch_names(tmp_path):
    model = _model()
    x, y = _data()
    every = kmp.callbacks.ModelCheckpoint(str(tmp_path / "e{epoch:02d}.keras"))
    best = kmp.callbacks.ModelCheckpoint(
        str(tmp_path / "best.weights.h5"),
        save_weights_only=True,
        save_best_only=True,
        monitor="loss",
    )
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[every, best])
    names = sorted(os.listdir(tmp_path))
    assert names == ["best.weights.h5", "e01.keras", "e02.keras", "e03.keras"], names
    # Adam's iterations in the weights file: 4 steps an epoch, the best epoch's count.
    fresh = _model()
    fresh.optimizer.build(fresh.trainable_variables)
    kmp.saving.load_weights(fresh, tmp_path / "best.weights.h5")
    assert int(fresh.optimizer.iterations.numpy()) in (4, 8, 12)
    assert float(best.best) == pytest.approx(min(model.history.history["loss"]))
    e3 = kmp.saving.load_model(tmp_path / "e03.keras")
    assert int(e3.optimizer.iterations.numpy()) == 12


def test_model_checkpoint_never_rewrites_the_previous_file(tmp_path):
    model = _model()
    x, y = _data()
    path = tmp_path / "last.keras"

    class Link(keras.callbacks.Callback):  # after the checkpoint: link each epoch's file
        def on_epoch_end(self, epoch, logs=None):
            os.link(path, tmp_path / f"epoch{epoch}.keras")

    ckpt = kmp.callbacks.ModelCheckpoint(str(path))
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[ckpt, Link()])
    for epoch in range(3):
        loaded = kmp.saving.load_model(tmp_path / f"epoch{epoch}.keras")
        assert int(loaded.optimizer.iterations.numpy()) == 4 * (epoch + 1)
    assert isinstance(ckpt, keras.callbacks.ModelCheckpoint)
    assert kmp.callbacks.ModelCheckpoint is ModelCheckpoint


# A save that runs out of room, in a subprocess: a file-size limit (EFBIG, no privileges
# needed) or, where this process may mount one, a 64 KiB tmpfs (ENOSPC: a real full disk).
_SAVE_TWICE = """
import json, os, resource, signal, sys
import keras
import keras_mp as kmp

path, limit = sys.argv[1], int(sys.argv[2])
inputs = keras.Input((64,))
model = keras.Model(inputs, keras.layers.Dense(90)(inputs))
kmp.saving.save_weights(model, path)
first = os.path.getsize(path)
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
model.layers[1].kernel.assign(model.layers[1].kernel + 1.0)
try:
    kmp.saving.save_weights(model, path)
    error = None
except OSError as e:
    error = [e.errno, str(e)]
print(json.dumps({"first": first, "after": os.path.getsize(path), "error": error,
                  "files": sorted(os.listdir(os.path.dirname(path)))}))
"""


def _save_twice(directory, limit):
    done = subprocess.run(
        [sys.executable, "-c", _SAVE_TWICE, os.path.join(directory, "w.weights.h5"), str(limit)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )  # fmt: skip
    # HDF5 itself may crash at exit after a failed write (SIGSEGV in its atexit close, with
    # or without keras_mp): the result line is printed before.
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), (done.returncode, done.stderr[-3000:])
    return json.loads(lines[-1]), done.stderr


def _check_no_room(out, stderr, path_dir):
    assert out["error"] is not None and out["after"] == out["first"]  # the old file is whole
    assert out["files"] == ["w.weights.h5"]  # the partial copy was removed
    message = out["error"][1]
    assert "room for two copies" in message and os.path.join(path_dir, "w.weights.h5") in message
    assert f"{2 * out['first']:,} bytes" in message  # the size it needs
    # h5py printed two "Exception ignored" tracebacks per failed save
    assert "Traceback" not in stderr and "decrement id ref count" not in stderr


def test_a_save_past_a_file_size_limit_says_it_needs_room_for_two_copies(tmp_path):
    out, stderr = _save_twice(str(tmp_path), limit=16384)
    assert out["error"][0] == errno.EFBIG
    _check_no_room(out, stderr, str(tmp_path))


@pytest.mark.slow  # a second TensorFlow subprocess; the file-size limit above runs in CI
def test_a_save_to_a_full_disk_says_it_needs_room_for_two_copies(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        out, stderr = _save_twice(str(disk), limit=0)
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert out["error"][0] == errno.ENOSPC
    _check_no_room(out, stderr, str(disk))
