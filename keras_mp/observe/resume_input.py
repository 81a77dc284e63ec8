"""Whether a resumed epoch's batches are the ones the interrupted run trained.

`kmp.callbacks.BackupAndRestore` resumes inside an epoch by reading as many batches as the
backup had trained and training the rest. That is exact when the input yields, in a new
process, the batches the interrupted process got: arrays without `steps_per_epoch`
(Keras' shuffle of them is drawn from NumPy's global random state, which the callback puts
back, or on TensorFlow by a seeded TensorFlow op). `order_warning` says, where it is not
or may not be, what to change.
"""

from __future__ import annotations

import keras

from keras_mp.keras_glue import keras_internals

__all__ = ["order_warning"]

_INPUTS = {  # Keras' data adapters, as a user names their input
    "TFDatasetAdapter": "a tf.data.Dataset",
    "PyDatasetAdapter": "a keras.utils.PyDataset",
    "GeneratorDataAdapter": "a Python generator",
    "TorchDataLoaderAdapter": "a torch DataLoader",
    "GrainDatasetAdapter": "a Grain dataset",
}


def _tf_seeded() -> bool | None:
    """Whether TensorFlow's global seed is set (None: cannot tell)."""
    try:
        from tensorflow.python.eager import context
    except ImportError:
        return None
    try:
        return context.global_seed() is not None
    except Exception:  # noqa: BLE001  (another TensorFlow: do not guess)
        return None


def order_warning(model: keras.Model, epoch: int, step: int) -> str | None:
    """Why the `fit` now running may not resume `epoch` at batch `step` exactly (a
    sentence naming the fix), or None where it does.

    Args:
        model: The model whose `fit` is running (called from a callback).
        epoch: The epoch resumed (0-based).
        step: The batches of it the backup had trained.
    """
    found = keras_internals.fit_input(model)
    where = f"epoch {epoch}, batch {step}"
    if found is None or found["kind"] != "ArrayDataAdapter":
        kind = "an input of unknown kind" if found is None else found["kind"]
        kind = _INPUTS.get(kind, kind)
        return (
            f"resuming inside an epoch ({where}) on {kind}: the first {step} batches the "
            "input yields are skipped and the rest trained. This is the interrupted run's "
            "order only if the input yields the same batches in a new process (a fixed "
            "order, or a shuffle seeded so that it does not depend on the epochs this "
            "process has read). Give `fit` arrays for an exact resume, or back up at epoch "
            "ends (save_freq='epoch')."
        )
    spe, batches = found["steps_per_epoch"], found["num_batches"]
    if spe and batches and spe != batches:
        return (
            f"resuming inside an epoch ({where}) with steps_per_epoch={spe} on arrays of "
            f"{batches} batches: Keras carries its place in the data over from epoch to "
            "epoch, which a new process does not know, so the batches are not the "
            "interrupted run's. Drop `steps_per_epoch` for an exact resume."
        )
    if found["shuffle"] and keras.backend.backend() == "tensorflow" and _tf_seeded() is False:
        return (
            f"resuming inside a shuffled epoch ({where}) on TensorFlow without a seed: the "
            "shuffle is drawn by a TensorFlow op, so the batches skipped are not the ones "
            "the interrupted run trained. Call `keras.utils.set_random_seed(...)` at the "
            "start of the program for an exact resume."
        )
    return None
