"""Atomic saving; loading `.keras` files and weights with clear errors, no half-restored state.

Plain `keras.models.load_model` reports a truncated archive as "File not found" and
an unknown registered class as "<Model> could not be deserialized properly" (the
real cause hidden in the exception context). Plain `model.load_weights` assigns
variables one object at a time: a file that fails part-way (a corrupt HDF5 group) or
whose optimizer does not match (Keras only warns) leaves the model restored and the
optimizer not, or half of the model restored. These two functions check first, name
the problem, and undo a failed load. `save_model` and `save_weights` (from
`keras_mp/saving/atomic.py`) write through a temporary file and `os.replace`: a process killed
mid-save leaves the previous file whole.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras
from keras import ops

import keras_mp.saving.plan as load_plan
import keras_mp.saving.sublayer_dtypes as sublayer_dtypes
from keras_mp.keras_glue.archive import read_config
from keras_mp.saving.atomic import save_model, save_weights
from keras_mp.saving.plan import reapply_plan

__all__ = ["load_model", "load_weights", "reapply_plan", "save_model", "save_weights"]

_SKIPPED = "Skipping variable loading for optimizer"


def _registered_names(config: Any, where: str = "config"):
    """Yields (registered_name, location) for every serialized object in `config`."""
    if isinstance(config, dict):
        name = config.get("registered_name")
        if isinstance(name, str) and ">" in name and "class_name" in config:
            yield name, where
        for key, value in config.items():
            yield from _registered_names(value, f"{where}.{key}")
    elif isinstance(config, (list, tuple)):
        for i, value in enumerate(config):
            yield from _registered_names(value, f"{where}[{i}]")


def _check_archive(filepath: str, custom_objects: dict | None) -> dict | None:
    """Raises a clear error if `filepath` is not a complete, loadable .keras archive.

    Returns the archive's parsed `config.json` (None for a path that is not a `.keras` file).
    """
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"No such file: {filepath!r}.")
    if os.path.isdir(filepath) or not filepath.endswith(".keras"):
        return None  # Keras' own checks (directory format, wrong extension) are clear.
    config = read_config(filepath)
    custom_objects = custom_objects or {}
    for name, where in _registered_names(config):
        if name in custom_objects or name.split(">", 1)[1] in custom_objects:
            continue
        if keras.saving.get_registered_object(name) is not None:
            continue
        package = name.split(">", 1)[0]
        if package == "keras_mp":
            from keras_mp.version import __version__

            known = sorted(
                n for n in keras.saving.get_custom_objects() if n.startswith("keras_mp>")
            )
            raise ValueError(
                f"{filepath!r} uses the keras_mp object {name!r} (at {where}), which "
                f"keras_mp {__version__} does not define. It was saved by another "
                f"keras_mp version or with a modified config. Known keras_mp objects: {known}."
            )
        raise ValueError(
            f"{filepath!r} uses the object {name!r} (at {where}), which is not registered. "
            f"Import the module that defines it (decorated with "
            f"@keras.saving.register_keras_serializable(package={package!r})) before loading, "
            "or pass it in `custom_objects`."
        )
    return config


def _dtypeless_layers(config: Any) -> list[str]:
    """The names of the custom layers whose saved config has no `dtype` (their
    `get_config` does not call `super().get_config()`)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            inner = node.get("config")
            if (
                isinstance(inner, dict)
                and isinstance(node.get("registered_name"), str)
                and ">" in node["registered_name"]
                and "dtype" not in inner
                and "build_config" in node
            ):
                found.append(node.get("name") or inner.get("name") or node["registered_name"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return found


def load_model(
    filepath: str | os.PathLike,
    custom_objects: dict | None = None,
    compile: bool = True,
    safe_mode: bool = True,
) -> keras.Model:
    """`keras.models.load_model`, after checking the archive and naming any problem.

    Checks, before Keras reads anything: the file exists; it is a complete zip (not
    truncated) whose members pass their CRC checks; it has a readable `config.json`;
    and every registered object it names (e.g. `keras_mp>Float32`) is known. Each
    failure raises a `ValueError` (`FileNotFoundError` for a missing file) that names
    the file and the problem. A successful check then defers to Keras, each layer made
    with the global dtype policy set to its saved dtype (`keras_mp.saving.sublayer_dtypes`:
    sublayers a custom layer makes in `__init__` take the global policy, not their
    parent's; float32 beside a float16 parent failed); the model and its nested
    Sequential and functional models get back the dtype policy their config saved
    (Keras gives them the global one, while their layers keep the saved one), and a
    `kmp.convert` model its precision plan: its boundary and output casts, the graph
    nodes that take token ids uncast, keras_mp's kernels (`keras_mp.saving.plan`).

    Args:
        filepath: Path to a `.keras` file (other paths go straight to Keras).
        custom_objects: As for `keras.models.load_model`.
        compile: As for `keras.models.load_model`.
        safe_mode: As for `keras.models.load_model`.

    Returns:
        The loaded `keras.Model`.

    Example:

    >>> model = keras_mp.saving.load_model("run/model.keras")  # doctest: +SKIP
    """
    filepath = os.fspath(filepath)
    config = _check_archive(filepath, custom_objects)
    try:
        with sublayer_dtypes.scope(), load_plan.scope():
            model = keras.models.load_model(
                filepath, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
            )
    except (ValueError, TypeError) as e:
        dtypeless = _dtypeless_layers(config)
        if not dtypeless:
            raise
        raise type(e)(
            f"{e}\n\n{filepath!r} holds layers saved without their dtype: {dtypeless} (their "
            "get_config() omits it, so they load with the global dtype policy, not the one "
            "they were saved in; the saved optimizer state is laid out for the saved "
            "dtypes). Re-save after giving each of them **kwargs in __init__, passed to "
            "super().__init__(**kwargs), and {**super().get_config(), ...} in get_config()."
        ) from e
    if not load_plan.applied(model):  # a model with its own from_config (keras_hub's)
        if config is not None:
            load_plan.restore_container_policies(model, config)
        reapply_plan(model)
    return model


def _state_variables(model: keras.Model) -> list:
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    return variables


def load_weights(
    model: keras.Model, filepath: str | os.PathLike, skip_mismatch: bool = False
) -> None:
    """`model.load_weights`, all or nothing: a failed load leaves `model` untouched.

    The values of the model's and its optimizer's variables are copied to host memory
    first; if loading raises, every variable gets its old value back and a `ValueError`
    naming the file is raised (the original error is its `__cause__`). With
    `skip_mismatch=False`, a saved optimizer state that does not match the model's
    optimizer (which Keras only warns about, after loading the weights) is also an
    error, so a resume never continues with new weights and stale optimizer slots.
    The optimizer is built first if needed, so its slots are restored too.

    Args:
        model: A built Keras model.
        filepath: A `.weights.h5` or `.keras` file.
        skip_mismatch: As for `model.load_weights`: load what matches, warn about the
            rest (no rollback for mismatches then; errors still roll back).

    Example:

    >>> keras_mp.saving.load_weights(model, "ckpt/latest.weights.h5")  # doctest: +SKIP
    """
    filepath = os.fspath(filepath)
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"No such file: {filepath!r}.")
    if filepath.endswith(".keras"):
        _check_archive(filepath, None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and model.built and not optimizer.built:
        optimizer.build(model.trainable_variables)
    variables = _state_variables(model)
    snapshot = [ops.convert_to_numpy(v.value) for v in variables]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.load_weights(filepath, skip_mismatch=skip_mismatch)
        skipped = [w for w in caught if str(w.message).startswith(_SKIPPED)]
        if skipped and not skip_mismatch:
            raise ValueError(str(skipped[0].message).strip())
    except Exception as e:
        for v, value in zip(variables, snapshot):
            v.assign(value)
        raise ValueError(
            f"Could not load weights from {filepath!r} into model {model.name!r}: {e} "
            "Nothing was changed: the model and its optimizer keep their previous values."
        ) from e
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
