"""Training children for tests/test_resume_kill.py, killed with SIGKILL in the middle of an epoch.

    python tests/_resume_kill_worker.py DIR POLICY

Imports Keras and keras_mp once, then reads commands on stdin, one a line, and answers
with JSON lines on stdout:

* `run NAME KILL [CALLBACK]`: forks a child that trains 3 epochs of 8 shuffled batches
  (`fit(x, y, batch_size=8, epochs=3)`, the same arguments every time) with
  `kmp.callbacks.BackupAndRestore("DIR/NAME/backup", save_freq=3)` (CALLBACK `stock`:
  `keras.callbacks.BackupAndRestore`). KILL is `none`, `between:N` (the child SIGKILLs
  itself after its backups are done for the run's N-th batch) or `write:N` (it SIGKILLs
  itself in the middle of writing the backup of the N-th batch: the temporary file is
  open, half written). A child that finishes writes `DIR/NAME/final.npz` (every model and
  optimizer variable, in order) and answers `{"done": {...}}`.
* `wait`: reaps the last child, answers `{"exit": its wait status}`.

The batches the final model has trained are counted in the model itself: the `Tap` layer
counts the training batches it sees and folds their sample ids (the last feature is
id / 64) into an order-sensitive digest, in int32 variables saved and restored with the
weights. So the count and digest of a resumed run equal an uninterrupted run's only if
no batch was skipped or trained twice, in the same order. `trained_here` counts the
batches this process computed (the real train function's calls).
"""

import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp.observe import backup_state  # noqa: E402

try:  # Keras imports TensorFlow at the first save on any backend: once here, not per child
    import tensorflow  # noqa: E402, F401
except ImportError:
    pass

SAMPLES, FEATURES, CLASSES, BATCH, EPOCHS = 64, 8, 4, 8, 3


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


@keras.saving.register_keras_serializable(package="resume_test")
class Tap(keras.layers.Layer):
    """The identity; in training, counts batches and digests their sample ids."""

    def build(self, shape):
        kw = dict(shape=(), dtype="int32", initializer="zeros", trainable=False)
        self.count = self.add_weight(name="count", **kw)
        self.digest = self.add_weight(name="digest", **kw)

    def call(self, x, training=False):
        if training:
            ids = ops.cast(ops.round(ops.cast(x[:, -1], "float32") * SAMPLES), "int32")
            code = ops.sum(ids * ops.arange(1, ops.shape(ids)[0] + 1, dtype="int32"))
            self.count.assign(self.count + 1)
            self.digest.assign(ops.mod(self.digest * 31 + code, 65521))
        return x


def build(policy: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            Tap(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(CLASSES),
        ]
    )
    model = kmp.convert(model, policy)
    if policy == "mixed_float16":  # a scale high enough to overflow, growing every 3 steps
        opt = kmp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0**24, growth_interval=3
        )
    else:
        opt = "adam"  # lean_bfloat16: kmp.LeanOptimizer
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    x[:, -1] = np.arange(SAMPLES) / SAMPLES
    y = rng.integers(0, CLASSES, SAMPLES).astype("int32")
    return x, y


class CountTrained(keras.callbacks.Callback):
    """First in the list: wraps the real train function to count its batches."""

    def __init__(self):
        super().__init__()
        self.batches = 0

    def on_train_begin(self, logs=None):
        real, per_call = self._model.train_function, self._model.steps_per_execution

        def counted(*args):
            self.batches += per_call
            return real(*args)

        self._model.train_function = counted


class KillBetween(keras.callbacks.Callback):
    """After the backup callback: SIGKILL once the run's `at`-th batch is done (Keras'
    own callback keeps no count: this process's batches, for a run started afresh)."""

    def __init__(self, backup, counter, at):
        super().__init__()
        self.backup, self.counter, self.at = backup, counter, at

    def on_train_batch_end(self, batch, logs=None):
        done = getattr(self.backup, "batches_trained", self.counter.batches)
        if done == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_mid_write(backup, at):
    """SIGKILL inside the backup write of the run's `at`-th batch: the temporary file
    holds the weights, its keras_mp group is created, the file is open and not flushed."""
    real = backup_state.write_state

    def write_state(path, state, model):
        if backup.batches_trained == at:
            f = h5py.File(path, "a")
            f.create_group(backup_state.GROUP).attrs["state"] = "{"
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, state, model)

    backup_state.write_state = write_state


def child(directory: str, policy: str, name: str, kill: str, stock: bool) -> None:
    out = os.path.join(directory, name)
    os.makedirs(out, exist_ok=True)
    x, y = data()
    model = build(policy)
    path = os.path.join(out, "backup")
    if stock:
        backup = keras.callbacks.BackupAndRestore(path, save_freq=3, delete_checkpoint=False)
    else:
        backup = kmp.callbacks.BackupAndRestore(path, save_freq=3, delete_checkpoint=False)
    counter = CountTrained()
    callbacks = [counter, backup]
    how, _, at = kill.partition(":")
    if how == "between":
        callbacks.append(KillBetween(backup, counter, int(at)))
    elif how == "write":
        kill_mid_write(backup, int(at))
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    variables = list(model.variables) + list(model.optimizer.variables)
    arrays = {f"{i:03d}": ops.convert_to_numpy(v.value) for i, v in enumerate(variables)}
    np.savez(os.path.join(out, "final.npz"), **arrays)
    tap = next(layer for layer in model.layers if isinstance(layer, Tap))
    emit(
        done={
            "resumed_at": getattr(backup, "resumed_at", None),
            "trained_here": counter.batches,
            "count": int(ops.convert_to_numpy(tap.count.value)),
            "digest": int(ops.convert_to_numpy(tap.digest.value)),
            "loss": [float(v) for v in history.history["loss"]],
            "skipped": int(ops.convert_to_numpy(model.optimizer.skipped_steps.value)),
            "paths": [v.path for v in variables],
        }
    )


def main() -> None:
    directory, policy = sys.argv[1], sys.argv[2]
    pid = None
    for line in sys.stdin:
        words = line.split()
        if words[0] == "wait":
            _, status = os.waitpid(pid, 0)
            emit(exit=status)
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                stock = len(words) > 3 and words[3] == "stock"
                child(directory, policy, words[1], words[2], stock)
            except BaseException as e:  # the test reads this line instead of hanging
                emit(error=f"{type(e).__name__}: {e}")
                code = 1
            os._exit(code)


if __name__ == "__main__":
    main()
