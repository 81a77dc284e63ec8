"""Training children for tests/test_checkpoint_kill.py, killed with SIGKILL mid-checkpoint.

    python tests/_checkpoint_kill_worker.py DIR WIDTH

Imports Keras and keras_mp once, then reads commands on stdin, one a line, and answers
with JSON lines on stdout:

* `run atomic` / `run stock`: forks a child that trains forever with
  `kmp.callbacks.ModelCheckpoint("DIR/last.keras", save_freq=1)` (`stock`:
  `keras.callbacks.ModelCheckpoint`). An `atomic` child first resumes from `last.keras`
  if it exists (`kmp.saving.load_model`) and answers `{"resumed": iterations, "scale": s}`
  (`{"fresh": true}` without a file). After its first checkpoint it answers
  `{"child": pid, "saved": iterations, "save_s": seconds the save took}`; the test then
  kills the child.
* `check`: as `run atomic`, but the child trains one step, saves, answers `{"done": ...}`
  and exits.
* `wait`: reaps the last child, answers `{"exit": its wait status}`.

Forking after the import (no TensorFlow op has run in this process, so it has no threads)
makes each kill cost a child's model build, not a whole TensorFlow start. The model is
two hidden Dense layers of WIDTH under `mixed_float16` via `kmp.convert`, so the file
holds loss-scale state and Adam's slots (WIDTH=512: about 3.5 MB).
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp as kmp  # noqa: E402

try:  # Keras imports TensorFlow at the first save on any backend: once here, not per child
    import tensorflow  # noqa: E402, F401
except ImportError:
    pass

FEATURES, CLASSES, BATCH = 32, 10, 32


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def state(model) -> dict:
    opt = model.optimizer
    return {
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
        "scale": float(keras.ops.convert_to_numpy(opt.loss_scale)),
        "optimizer": type(opt).__name__,
    }


def build(width: int):
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )
    model = kmp.convert(model, "mixed_float16")
    model.compile(optimizer="adam", loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Timer(keras.callbacks.Callback):
    """Placed before the checkpoint callback: the time a batch's save starts."""

    def on_train_batch_end(self, batch, logs=None):
        self.start = time.perf_counter()


class FirstSave(keras.callbacks.Callback):
    """Placed after the checkpoint callback: answers once, after the first save."""

    def __init__(self, timer):
        super().__init__()
        self.timer, self.done = timer, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.done:
            self.done = True
            seconds = time.perf_counter() - self.timer.start
            emit(child=os.getpid(), saved=state(self.model)["iterations"], save_s=seconds)


def child(mode: str, path: str, width: int, steps: int) -> None:
    rng = np.random.default_rng(os.getpid())
    x = rng.normal(size=(BATCH * 8, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=BATCH * 8).astype("int32")
    if mode == "stock":
        model, ckpt = build(width), keras.callbacks.ModelCheckpoint(path, save_freq=1)
    else:
        if os.path.exists(path):
            model = kmp.saving.load_model(path)
            emit(resumed=state(model))
        else:
            model = build(width)
            emit(fresh=True)
        ckpt = kmp.callbacks.ModelCheckpoint(path, save_freq=1)
    timer = Timer()
    if steps:
        model.fit(x[: BATCH * steps], y[: BATCH * steps], batch_size=BATCH, epochs=1,
                  verbose=0, callbacks=[timer, ckpt, FirstSave(timer)])  # fmt: skip
        emit(done=state(model))
        return
    model.fit(x, y, batch_size=BATCH, epochs=10**6, verbose=0,
              callbacks=[timer, ckpt, FirstSave(timer)])  # fmt: skip


def main() -> None:
    directory, width = sys.argv[1], int(sys.argv[2])
    path = os.path.join(directory, "last.keras")
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
                child(words[-1] if words[0] == "run" else "atomic", path, width,
                      steps=1 if words[0] == "check" else 0)  # fmt: skip
            except BaseException as e:  # the test reads this line instead of hanging
                emit(error=f"{type(e).__name__}: {e}")
                code = 1
            os._exit(code)


if __name__ == "__main__":
    main()
