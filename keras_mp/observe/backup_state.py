"""What a `kmp.callbacks.BackupAndRestore` backup holds beyond `model.save_weights`.

`model.save_weights` writes the layers' and the optimizer's variables (for
`kmp.LossScaleOptimizer` the loss scale, its good-step counter, hysteresis and skip
count; for `kmp.LeanOptimizer` its compact moments). A resume exact at a batch needs
more, all written into the same `.weights.h5` file (an HDF5 group Keras' loader does not
read) so that one `os.replace` commits all of it at once:

* the position: the epoch in progress, the batches of it trained (`step`), and the
  batches trained since the run began, counted by the callback itself;
* the metrics' accumulators (`model.metrics_variables`, which `save_weights` leaves out),
  so the interrupted epoch's logs average over all its batches;
* the states of the layers' seed generators (`Dropout`'s; also left out), so a resumed
  step draws the same dropout mask;
* the global random states of NumPy and Python as they were when the epoch in progress
  began: `fit` draws its shuffle of array inputs from NumPy's when an epoch starts (JAX
  and PyTorch backends), so the resumed epoch is shuffled as the interrupted one was.
"""

from __future__ import annotations

import json
import random
from typing import Any

import h5py
import keras
import numpy as np
from keras import ops

__all__ = [
    "GROUP",
    "assign_extra",
    "capture_rng",
    "check_extra",
    "extra_variables",
    "read_state",
    "restore_rng",
    "write_state",
]

GROUP = "keras_mp_backup"  # the HDF5 group beside Keras' `layers`, `optimizer`, `vars`
FORMAT = 1


def capture_rng() -> dict:
    """NumPy's and Python's global random states, as JSON-ready values."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "python": [version, list(internal), gauss],
    }


def restore_rng(state: dict) -> None:
    """Sets NumPy's and Python's global random states to what `capture_rng` returned."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def extra_variables(model: keras.Model) -> dict[str, list]:
    """The variables a backup adds to `save_weights`: the metrics' accumulators and the
    layers' seed-generator states, each list in a fixed order."""
    seeds = [v for v in model.variables if v.path.endswith("seed_generator_state")]
    return {"metrics": list(model.metrics_variables), "seeds": seeds}


def write_state(path: str, state: dict, model: keras.Model) -> None:
    """Adds `state` (JSON-ready) and the model's extra variables to the weights file
    `path` (the temporary file of an atomic write, before it is committed)."""
    with h5py.File(path, "a") as f:
        group = f.create_group(GROUP)
        group.attrs["format"] = FORMAT
        group.attrs["state"] = json.dumps(state)
        for kind, variables in extra_variables(model).items():
            sub = group.create_group(kind)
            for i, v in enumerate(variables):
                sub.create_dataset(str(i), data=ops.convert_to_numpy(v.value))
                sub[str(i)].attrs["path"] = v.path


def read_state(path: str) -> tuple[dict, dict[str, list]] | None:
    """`(state, {"metrics": [...], "seeds": [...]})` from a backup, or None where the
    file has no keras_mp group (a `keras.callbacks.BackupAndRestore` file).

    Raises:
        ValueError: the group is of a newer format than this keras_mp reads.
        OSError: the file is not a readable HDF5 file.
    """
    with h5py.File(path, "r") as f:
        if GROUP not in f:
            return None
        group = f[GROUP]
        version = int(group.attrs["format"])
        if version > FORMAT:
            raise ValueError(
                f"{path!r} is a backup of format {version}, written by a newer keras_mp; "
                f"this one reads format {FORMAT}. Upgrade keras_mp to resume from it."
            )
        state = json.loads(group.attrs["state"])
        arrays: dict[str, list[Any]] = {}
        for kind in ("metrics", "seeds"):
            sub = group.get(kind)
            count = 0 if sub is None else len(sub)
            arrays[kind] = [(sub[str(i)].attrs["path"], sub[str(i)][()]) for i in range(count)]
    return state, arrays


def check_extra(model: keras.Model, arrays: dict[str, list], where: str, kind: str) -> None:
    """Raises a `ValueError` where the model's extra variables of one kind (`"metrics"`,
    `"seeds"`) do not match a backup's (their number and shapes; the paths may differ
    with the order models were made in)."""
    mine = [tuple(v.shape) for v in extra_variables(model)[kind]]
    theirs = [tuple(np.shape(a)) for _, a in arrays[kind]]
    if mine != theirs:
        raise ValueError(
            f"The backup {where!r} holds {len(theirs)} {kind} variables of shapes "
            f"{theirs}, but this model has {len(mine)} of shapes {mine}: it was made "
            "by a model built or compiled differently. Resume with the same model, "
            "`compile` and `fit` arguments, or delete the backup to start over."
        )


def assign_extra(model: keras.Model, kind: str, arrays: dict[str, list]) -> None:
    """Assigns the saved values of one kind of extra variable (`"metrics"`, `"seeds"`),
    checked by `check_extra` first."""
    for v, (_, value) in zip(extra_variables(model)[kind], arrays[kind]):
        v.assign(value)
