"""`kmp.callbacks.ModelCheckpoint`: Keras' checkpoint callback with atomic writes.

Stock `keras.callbacks.ModelCheckpoint` rewrites its file in place, so a run killed while
it saves (`save_freq=1` makes that likely) leaves a truncated file and no checkpoint at
all. This subclass takes the same arguments and saves through `kmp.saving.save_model` /
`save_weights`: a temporary file, `fsync`, `os.replace`.
"""

from __future__ import annotations

import os

import keras

from keras_mp import saving

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` whose writes are atomic.

    Same arguments and behaviour as Keras' callback (`save_best_only`,
    `save_weights_only`, `{epoch}`/`{val_loss}` formatting, `save_freq` in batches or
    `"epoch"`, `initial_value_threshold`); only the write differs. The checkpoint goes to a
    temporary file in the same directory, is flushed to disk and replaces the previous
    one with `os.replace`, so a process killed at any moment (`kill -9`, pre-emption)
    leaves the last complete checkpoint; leftovers of a killed save are removed by the
    next one. A `.keras` checkpoint holds the optimizer's state (loss scale, counters,
    lean moments), not the position in the data: to resume a killed run at the batch
    where it stopped, use `kmp.callbacks.BackupAndRestore`.

    Args:
        filepath: As for `keras.callbacks.ModelCheckpoint`: a `.keras` file, or a
            `.weights.h5` file with `save_weights_only=True`; may hold `{epoch}` and
            log-key formatting.
        **kwargs: The other arguments of `keras.callbacks.ModelCheckpoint` (`monitor`,
            `verbose`, `save_best_only`, `save_weights_only`, `mode`, `save_freq`,
            `initial_value_threshold`).

    Example:

    >>> ckpt = kmp.callbacks.ModelCheckpoint("run/last.keras", save_freq=100)  # doctest: +SKIP
    >>> model.fit(x, y, epochs=10, callbacks=[ckpt])  # doctest: +SKIP
    >>> model = kmp.saving.load_model("run/last.keras")  # doctest: +SKIP
    """

    def _save_model(self, epoch, batch, logs):
        # Keras' `_save_model` minus its in-place write; the decision (`_should_save_model`)
        # and the path (`_get_file_path`) stay Keras' own.
        filepath = self._get_file_path(epoch, batch, logs)
        if os.path.isdir(filepath):
            raise IsADirectoryError(
                "Please specify a non-directory filepath for ModelCheckpoint. Filepath "
                f"used is an existing directory: {filepath}"
            )
        if not self._should_save_model(epoch, batch, logs, filepath):
            return
        if self.save_weights_only:
            saving.save_weights(self.model, filepath, overwrite=True)
        else:
            saving.save_model(self.model, filepath, overwrite=True)
        if self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished saving model to {filepath}", flush=True)
