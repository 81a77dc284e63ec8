"""`kmp.callbacks.BackupAndRestore` in one process: interruptions raised from a callback.

The real-kill tests (SIGKILL, mid-write) are in tests/test_resume_kill.py; these check
the rest quickly: `steps_per_execution`, the arguments, a resume with other `fit`
arguments, inputs that cannot be resumed exactly, the files left, the fallbacks.
"""

import os
import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp

X = np.random.default_rng(1).normal(size=(48, 6)).astype("float32")
Y = (X[:, :3].argmax(-1)).astype("int32")


class Interrupt(Exception):
    pass


class StopAt(keras.callbacks.Callback):
    """Raises after this fit's `at`-th batch (its `on_train_batch_end` calls)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise Interrupt


def _model(steps_per_execution=1):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


def _weights(model):
    return [keras.ops.convert_to_numpy(v.value) for v in model.weights + model.optimizer.variables]


def _fit(model, backup, stop=None, **kwargs):
    kwargs = {"batch_size": 8, "epochs": 2, "verbose": 0, **kwargs}
    callbacks = [backup] + ([StopAt(stop)] if stop else [])
    try:
        return model.fit(X, Y, callbacks=callbacks, **kwargs)
    except Interrupt:
        return None


def test_resume_with_steps_per_execution_matches_an_uninterrupted_run(tmp_path):
    reference = _model(2)
    history = reference.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    path = tmp_path / "backup"
    # 6 batches an epoch, 2 a call, a backup every 4: the last before the stop is at
    # batch 8 (epoch 1, batch 2); the stop comes after batch 10.
    assert _fit(_model(2), kmp.callbacks.BackupAndRestore(path, save_freq=4), stop=5) is None
    backup = kmp.callbacks.BackupAndRestore(path, save_freq=4)
    model = _model(2)
    resumed = _fit(model, backup)
    assert backup.resumed_at == (1, 2) and backup.batches_trained == 12
    assert resumed.history["loss"] == history.history["loss"][1:]
    for a, b in zip(_weights(model), _weights(reference)):
        np.testing.assert_array_equal(a, b)
    assert not os.path.exists(path)  # delete_checkpoint=True: gone once fit completes


@pytest.mark.parametrize("save_freq", [0, -3, False, True, "batch", 2.5])
def test_save_freq_must_be_epoch_or_a_positive_integer(tmp_path, save_freq):
    with pytest.raises(ValueError, match="save_freq="):
        kmp.callbacks.BackupAndRestore(tmp_path, save_freq=save_freq)


def test_a_remote_or_empty_backup_dir_is_refused():
    with pytest.raises(ValueError, match="local or mounted"):
        kmp.callbacks.BackupAndRestore("gs://bucket/run")
    with pytest.raises(ValueError, match="backup_dir is empty"):
        kmp.callbacks.BackupAndRestore("")


def test_resume_with_another_batch_size_raises_and_changes_nothing(tmp_path):
    path = tmp_path / "backup"
    _fit(_model(), kmp.callbacks.BackupAndRestore(path, save_freq=2), stop=9)
    model = _model()
    before = (
        _weights(model)
        if model.optimizer.built
        else [keras.ops.convert_to_numpy(v.value) for v in model.weights]
    )
    with pytest.raises(ValueError, match="batch_size") as e:
        _fit(model, kmp.callbacks.BackupAndRestore(path, save_freq=2), batch_size=16)
    assert "batch 2 of an epoch of 6 batches" in str(e.value) and "has 3" in str(e.value)
    for a, v in zip(before, model.weights):
        np.testing.assert_array_equal(a, keras.ops.convert_to_numpy(v.value))
    assert os.path.exists(path / "latest.weights.h5")  # the backup is kept


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return X[8 * i : 8 * i + 8], Y[8 * i : 8 * i + 8]


def test_resuming_inside_an_epoch_of_a_dataset_warns_that_order_is_the_inputs(tmp_path):
    path = tmp_path / "backup"
    model = _model()
    try:
        backup = kmp.callbacks.BackupAndRestore(path, save_freq=4)
        model.fit(Batches(), epochs=2, verbose=0, callbacks=[backup, StopAt(9)])
    except Interrupt:
        pass
    backup = kmp.callbacks.BackupAndRestore(path, save_freq=4)
    with pytest.warns(UserWarning, match="keras.utils.PyDataset: the first 2 batches"):
        _model().fit(Batches(), epochs=2, verbose=0, callbacks=[backup])
    assert backup.resumed_at == (1, 2)


def test_double_checkpoint_falls_back_to_the_previous_backup(tmp_path):
    path = tmp_path / "backup"
    _fit(_model(), kmp.callbacks.BackupAndRestore(path, 2, double_checkpoint=True), stop=9)
    assert sorted(os.listdir(path)) == ["latest.weights.h5", "previous.weights.h5"]
    with open(path / "latest.weights.h5", "r+b") as f:  # a damaged disk
        f.write(b"\0" * 4096)
    backup = kmp.callbacks.BackupAndRestore(path, 2, double_checkpoint=True)
    with pytest.warns(UserWarning, match="previous backup"):
        _fit(_model(), backup)
    assert backup.resumed_at == (0, 6)  # the backup of batch 6 (epoch 0 done), not of 8


def test_a_backup_made_by_keras_callback_resumes_at_its_epoch(tmp_path):
    path = tmp_path / "backup"
    _fit(_model(), keras.callbacks.BackupAndRestore(path), stop=9)  # after epoch 0's backup
    backup = kmp.callbacks.BackupAndRestore(path)
    with pytest.warns(UserWarning, match="written by keras.callbacks.BackupAndRestore"):
        history = _fit(_model(), backup)
    assert backup.resumed_at == (1, 0) and len(history.history["loss"]) == 1


def test_a_fresh_fit_keeps_only_its_backup_and_a_finished_one_starts_over(tmp_path):
    path = tmp_path / "backup"
    backup = kmp.callbacks.BackupAndRestore(path, save_freq=5, delete_checkpoint=False)
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning on a fresh run
        _fit(model, backup)
    assert backup.resumed_at is None and backup.batches_trained == 12
    assert sorted(os.listdir(path)) == ["latest.weights.h5"]
    # The next fit on the same model starts where asked (Keras' callback leaves its
    # restored epoch on the model): the backup says epoch 1 batch 4, all trained.
    again = kmp.callbacks.BackupAndRestore(path, save_freq=5)
    history = _fit(model, again, epochs=3)
    assert again.resumed_at == (1, 4) and len(history.history["loss"]) == 2
    history = model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1


@pytest.mark.tf_only
def test_resuming_a_shuffled_epoch_on_tensorflow_without_a_seed_warns(tmp_path):
    import tensorflow as tf

    path = tmp_path / "backup"
    _fit(_model(), kmp.callbacks.BackupAndRestore(path, save_freq=4), stop=9)
    model = _model()
    tf.random.set_seed(None)  # as in a program that never sets one
    try:
        with pytest.warns(UserWarning, match="keras.utils.set_random_seed"):
            _fit(model, kmp.callbacks.BackupAndRestore(path, save_freq=4))
    finally:
        keras.utils.set_random_seed(0)


def test_a_backup_failing_half_way_keeps_the_previous_one(tmp_path, monkeypatch):
    from keras_mp.observe import backup_state

    path = tmp_path / "backup"
    real, calls = backup_state.write_state, []

    def disk_full_at_the_second(tmp, state, model):
        calls.append(state["step"])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(tmp, state, model)

    monkeypatch.setattr(backup_state, "write_state", disk_full_at_the_second)
    with pytest.raises(OSError, match="No space left"):
        _fit(_model(), kmp.callbacks.BackupAndRestore(path, save_freq=4))
    assert sorted(os.listdir(path)) == ["latest.weights.h5"]  # no temporary file left
    monkeypatch.setattr(backup_state, "write_state", real)
    backup = kmp.callbacks.BackupAndRestore(path, save_freq=4)
    _fit(_model(), backup)
    assert backup.resumed_at == (0, 4)  # the first backup, whole
