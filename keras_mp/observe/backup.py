"""`kmp.callbacks.BackupAndRestore`: a killed `fit` resumes at the batch where it stopped.

Keras' `keras.callbacks.BackupAndRestore` restores the epoch only (the batch it saves is
unused, so an interrupted epoch trains its first batches again) and writes its two files
in place (a kill mid-write loses the backup). This subclass takes the same arguments and:

* writes one file, atomically (`keras_mp.saving.atomic`): the model's and optimizer's variables
  and, in the same file, the position and the rest of the training state
  (`keras_mp.observe.backup_state`); a kill at any instant leaves the previous backup;
* counts the batches itself (the epoch, the batches of it done, the batches trained in
  all), not from `optimizer.iterations`;
* on restart, restores it all before the first epoch and skips the batches of the
  interrupted epoch that the backup has trained: they are read from the input (so a
  shuffled input is in the same place) but not trained, and training goes on at the next
  batch. The global NumPy and Python random states are put back as they were when that
  epoch began, so `fit`'s shuffle of array inputs draws the same order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from typing import Any

import keras
from keras import ops

from keras_mp.keras_glue import keras_internals
from keras_mp.observe import backup_state, resume_input
from keras_mp.saving.atomic import atomic_path, remove_stale
from keras_mp.saving.load import load_weights

__all__ = ["BackupAndRestore"]

logger = logging.getLogger("keras_mp")

_LATEST, _PREVIOUS = "latest.weights.h5", "previous.weights.h5"
_KERAS_METADATA = "training_metadata.json"  # what Keras' own callback writes beside


def _save_freq(value: Any) -> str | int:
    if value == "epoch":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"save_freq={value!r}: give 'epoch' (a backup at the end of each epoch) or a "
            "positive integer (a backup every that many batches)."
        )
    return value


class _SkipBatches:
    """Stands in for `model.train_function` over the batches of the resumed epoch that the
    backup has trained: each call reads its batches from the iterator it gets (as the real
    function would) and trains nothing. Past them it is the real function."""

    def __init__(self, real, batches: int, per_call: int, logs: dict | None, first):
        self.real, self.remaining, self.per_call = real, batches, per_call
        self.logs, self.first = logs, first  # first(a batch) -> logs, where logs is None
        self.backend = keras.backend.backend()

    def __call__(self, *args):
        if self.remaining <= 0:
            return self.real(*args)
        self.remaining -= self.per_call
        data = args[-1]  # TensorFlow: (iterator); JAX: (state, iterator); PyTorch: (data)
        if hasattr(data, "__next__"):  # the function reads its batches itself
            data = [next(data) for _ in range(self.per_call)]
        if self.logs is None:
            self.logs = self.first(data[0] if isinstance(data, (list, tuple)) else None)
        if self.backend == "jax":  # train_function(state, data) -> (logs, state)
            return dict(self.logs), args[0]
        return dict(self.logs)


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore`, atomic and exact at the batch where a run stopped.

    A drop-in for Keras' callback (the same arguments). Put it in `fit`'s callbacks; when
    the process is killed (`kill -9`, a pre-empted node, the OOM killer), run the same
    program again: `fit` with the same arguments restores the last backup and continues
    at the batch after it. No batch of the interrupted epoch is trained twice or left out,
    and an array input shuffled by `fit` comes in the same order, so the run ends with the
    weights of a run never interrupted (bit for bit where the backend is deterministic).

    A backup holds the model's weights; the optimizer's state (for
    `kmp.LossScaleOptimizer` the loss scale, its good-step counter, hysteresis and skip
    count; for `kmp.LeanOptimizer` its compact moments); the epoch and the batches of it
    trained, counted by the callback (`optimizer.iterations` counts applied updates, not
    batches); the metrics' running totals (the interrupted epoch's logs average over all
    its batches); the layers' seed-generator states (dropout masks); and NumPy's and
    Python's global random states at the epoch's start. Other callbacks' state
    (`EarlyStopping`'s patience count, `ReduceLROnPlateau`'s, `ModelCheckpoint`'s best
    value) is not in it, as with Keras' callback. The batches skipped on a resume go
    through the other callbacks' `on_train_batch_begin`/`end` with the logs as they
    stood at the backup (the progress bar runs through them).

    Exact for array inputs (NumPy, tensors) without `steps_per_epoch`, shuffled or not; on
    TensorFlow a shuffled one needs a seed (`keras.utils.set_random_seed` at the start of
    the program), as its shuffle is drawn by a TensorFlow op. For a `tf.data.Dataset`, a
    `PyDataset` or a generator the resumed epoch reads the batches the input yields, skips
    as many as the backup has trained and trains the rest: exact only if the input yields
    the same batches in a new process (a warning says so on such a resume).

    Each backup replaces the previous one with `os.replace` after it is written and
    flushed to disk. A fresh `fit` (no backup) starts as usual; at its end the backup is
    deleted (`delete_checkpoint=True`).

    Args:
        backup_dir: The directory of the backup (`latest.weights.h5`; with
            `double_checkpoint`, also `previous.weights.h5`). Used by this run alone.
            A local or mounted path: the write is committed by a rename.
        save_freq: `"epoch"` (a backup at the end of each epoch) or an integer: a backup
            every that many batches (counted across epochs).
        double_checkpoint: Keep the backup before the latest as well; a resume falls
            back to it if the latest cannot be read (a damaged disk).
        delete_checkpoint: Delete the backup when `fit` completes.

    Attributes:
        resumed_at: `(epoch, batch)` the last `fit` resumed at (0-based; `batch` trained
            batches of `epoch` were restored), or None if it started afresh.
        batches_trained: Batches trained since the run began, across restarts.

    Example:

    >>> backup = kmp.callbacks.BackupAndRestore("run/backup", save_freq=100)  # doctest: +SKIP
    >>> model.fit(x, y, epochs=10, callbacks=[backup])  # doctest: +SKIP
    >>> # killed? run the same program again: `fit` goes on at the next batch
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ):
        if not backup_dir:
            raise ValueError("backup_dir is empty: give the directory the backup goes to.")
        backup_dir = os.fspath(backup_dir)
        if "://" in backup_dir:
            raise ValueError(
                f"backup_dir={backup_dir!r}: kmp.callbacks.BackupAndRestore commits a backup "
                "by renaming a file, which object stores cannot do. Give a local or mounted "
                "directory (or use keras.callbacks.BackupAndRestore, which is not atomic)."
            )
        super().__init__(
            backup_dir,
            save_freq=_save_freq(save_freq),
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        self._weights_path = os.path.join(backup_dir, _LATEST)
        self._prev_weights_path = os.path.join(backup_dir, _PREVIOUS)
        self.resumed_at: tuple[int, int] | None = None
        self.batches_trained = 0
        self._epoch = self._step = self._since = self._skip_to = 0
        self._rng: dict | None = None
        self._restore: tuple[dict, dict | None] | None = None

    # -- restore ------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        self._unwrap()
        self._epoch = self._step = self._since = self._skip_to = 0
        self.batches_trained, self.resumed_at, self._restore = 0, None, None
        found = self._restore_latest(model)
        if found is None:
            return
        path, state, arrays = found
        epoch, step = int(state["epoch"]), int(state["step"])
        keras_internals.set_initial_epoch(model, epoch)
        self._epoch, self._step = epoch, step
        self.batches_trained = int(state.get("batches_trained", 0))
        self.resumed_at = (epoch, step)
        self._restore = state, arrays
        logger.info("BackupAndRestore: resumed from %s at epoch %d, batch %d", path, epoch, step)
        if step:
            self._check_input(step)

    def _restore_latest(self, model) -> tuple[str, dict, dict | None] | None:
        """Loads the newest readable backup into `model`: `(path, state, arrays)`, or
        None without one. Falls back to the previous backup where the latest is damaged."""
        paths = [p for p in (self._weights_path, self._prev_weights_path) if os.path.exists(p)]
        errors = []
        for path in paths:
            try:
                found = backup_state.read_state(path)
            except (OSError, ValueError, KeyError) as e:
                errors.append(f"{path}: {e}")
                continue
            state, arrays = found if found is not None else (self._keras_state(path), None)
            if not model.built:
                raise ValueError(
                    "BackupAndRestore: the model must be built before `fit` restores a "
                    f"backup into it; model {model.name!r} is not. Build it (call it on a "
                    "batch, or give it an `Input`) before `fit`."
                )
            self._check_position(state, path)
            if arrays is not None:
                backup_state.check_extra(model, arrays, path, "seeds")
            try:
                load_weights(model, path)  # all or nothing; a stale optimizer state raises
            except ValueError as e:
                errors.append(f"{path}: {e}")
                continue
            if arrays is not None:
                backup_state.assign_extra(model, "seeds", arrays)
            if errors:
                warnings.warn(
                    f"BackupAndRestore: resumed from the previous backup {path!r}; the "
                    f"latest could not be read ({errors[0]}).",
                    stacklevel=2,
                )
            return path, state, arrays
        if errors:
            raise ValueError(
                f"BackupAndRestore: no backup in {self.backup_dir!r} could be restored: "
                f"{'; '.join(errors)}. Delete the directory to start over."
            )
        return None

    def _keras_state(self, path: str) -> dict:
        """The position in a backup made by `keras.callbacks.BackupAndRestore`: the start
        of its epoch (Keras' callback resumes there, whatever batch its weights are of)."""
        metadata = os.path.join(self.backup_dir, _KERAS_METADATA)
        epoch = 0
        if os.path.exists(metadata):
            with open(metadata) as f:
                epoch = int(json.load(f).get("epoch", 0))
        warnings.warn(
            f"BackupAndRestore: {path!r} was written by keras.callbacks.BackupAndRestore, "
            f"which keeps no exact position: resuming at the start of epoch {epoch}, as it "
            "would (the batches of that epoch it had trained are trained again; no metrics "
            "or random state). The next backups are keras_mp's.",
            stacklevel=3,
        )
        return {"epoch": epoch, "step": 0}

    def _check_position(self, state: dict, path: str) -> None:
        steps, step = self.params.get("steps"), int(state["step"])
        saved = state.get("steps_per_epoch")
        if step and steps and saved and steps != saved:
            raise ValueError(
                f"BackupAndRestore: the backup {path!r} stopped at batch {step} of an epoch of "
                f"{saved} batches; this `fit` has {steps} batches an epoch. Resuming inside "
                "an epoch needs the same data, `batch_size` and `steps_per_epoch`: pass "
                f"them, or delete {self.backup_dir!r} to start over."
            )
        per_call = int(getattr(self._model, "steps_per_execution", 1) or 1)
        if step % per_call and step != steps:
            raise ValueError(
                f"BackupAndRestore: the backup {path!r} stopped at batch {step}, inside a "
                f"group of steps_per_execution={per_call}. Compile with the "
                f"steps_per_execution of the interrupted run ({state.get('steps_per_execution')})."
            )

    def _check_input(self, step: int) -> None:
        """Warns where the resumed epoch's batches may not be the interrupted one's."""
        message = resume_input.order_warning(self._model, self._epoch, step)
        if message is not None:
            warnings.warn(f"BackupAndRestore: {message}", stacklevel=3)

    # -- count and back up ----------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        model = self._model
        if keras_internals.initial_epoch(model) is not None:
            keras_internals.set_initial_epoch(model, None)  # the next `fit` starts as asked
        restore, self._restore = self._restore, None
        self._epoch, self._step, self._skip_to = epoch, 0, 0
        if restore is None or int(restore[0]["epoch"]) != epoch:
            self._rng = backup_state.capture_rng()
            return
        state, arrays = restore
        self._rng = state.get("rng")
        if self._rng is not None:
            backup_state.restore_rng(self._rng)
        else:
            self._rng = backup_state.capture_rng()
        self._step = self._skip_to = int(state["step"])
        if not self._skip_to:
            return
        # The metrics' totals, after `fit` reset them: now where they are built (JAX builds
        # them before the first epoch, and reads them into its state at the first batch);
        # on TensorFlow, built at the first step's trace, from the first batch skipped.
        built = arrays is None or len(model.metrics_variables) == len(arrays["metrics"])
        logs = self._restore_metrics(arrays) if built else None
        per_call = int(getattr(model, "steps_per_execution", 1) or 1)
        model.train_function = _SkipBatches(
            model.train_function,
            self._skip_to,
            per_call,
            logs,
            lambda batch: self._restore_metrics(arrays, batch),
        )

    def _restore_metrics(self, arrays: dict | None, batch: Any = None) -> dict:
        """Gives the metrics their totals at the backup; returns the logs they make."""
        model = self._model
        if arrays is not None:
            if batch is not None and len(model.metrics_variables) != len(arrays["metrics"]):
                keras_internals.symbolic_build(model, batch)
            backup_state.check_extra(model, arrays, self._weights_path, "metrics")
            backup_state.assign_extra(model, "metrics", arrays)
        return keras.tree.map_structure(ops.convert_to_numpy, model.get_metrics_result())

    def on_train_batch_end(self, batch, logs=None):
        end = batch + 1
        steps = self.params.get("steps")
        if steps:
            end = min(end, steps)  # the last group of steps_per_execution may be short
        if end <= self._skip_to:  # a batch the backup had trained
            if end == self._skip_to:
                self._unwrap()
            return
        done = end - self._step
        self._step = end
        self.batches_trained += done
        self._since += done
        if self.save_freq != "epoch" and self._since >= self.save_freq:
            self._since = 0
            self._save_model()

    def on_epoch_end(self, epoch, logs=None):
        self._unwrap()
        self._epoch, self._step, self._skip_to = epoch + 1, 0, 0
        self._rng = backup_state.capture_rng()  # the next epoch starts from here
        if self.save_freq == "epoch":
            self._save_model()

    def _save_model(self):
        model = self.model  # on JAX, brings the training state back to the variables
        from keras_mp.version import __version__

        state = {
            "epoch": self._epoch,
            "step": self._step,
            "batches_trained": self.batches_trained,
            "steps_per_epoch": self.params.get("steps"),
            "steps_per_execution": int(getattr(model, "steps_per_execution", 1) or 1),
            "rng": self._rng,
            "backend": keras.backend.backend(),
            "keras_mp": __version__,
        }
        os.makedirs(self.backup_dir, exist_ok=True)
        if self.double_checkpoint and os.path.exists(self._weights_path):
            # A kill before the new latest is committed leaves this one as the newest.
            os.replace(self._weights_path, self._prev_weights_path)
        with atomic_path(self._weights_path) as tmp:
            model.save_weights(tmp, overwrite=True)
            backup_state.write_state(tmp, state, model)

    def on_train_end(self, logs=None):
        self._unwrap()
        if keras_internals.initial_epoch(self._model) is not None:
            keras_internals.set_initial_epoch(self._model, None)
        if not self.delete_checkpoint or not os.path.isdir(self.backup_dir):
            return
        names = (_LATEST, _PREVIOUS, _KERAS_METADATA, _KERAS_METADATA + ".bkp")
        for path in [os.path.join(self.backup_dir, n) for n in names]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        remove_stale(self._weights_path)
        with contextlib.suppress(OSError):  # left where it holds other files
            os.rmdir(self.backup_dir)

    def _unwrap(self) -> None:
        """Gives the model its own train function back (after a skip, or one left by a
        `fit` that raised)."""
        model = self._model
        function = getattr(model, "train_function", None)
        while isinstance(function, _SkipBatches):
            function = function.real
        if model is not None and getattr(model, "train_function", None) is not function:
            model.train_function = function
