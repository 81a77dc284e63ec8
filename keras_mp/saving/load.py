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

import json
import os
import warnings
import zipfile
from typing import Any

import keras
from keras import ops

import keras_mp.saving.sublayer_dtypes as sublayer_dtypes
from keras_mp.saving.atomic import save_model, save_weights

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
    size = os.path.getsize(filepath)
    if not zipfile.is_zipfile(filepath):
        raise ValueError(
            f"{filepath!r} ({size} bytes) is not a valid .keras archive: it is not a zip "
            "file, or it is truncated (its zip directory is missing). Re-save or re-copy it."
        )
    try:
        with zipfile.ZipFile(filepath) as archive:
            bad = archive.testzip()
            names = archive.namelist()
            raw = archive.read("config.json") if "config.json" in names else None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"{filepath!r} ({size} bytes) is a corrupt .keras archive: {e}") from e
    if bad is not None:
        raise ValueError(
            f"{filepath!r} is a corrupt .keras archive: member {bad!r} fails its CRC check "
            "(the file was damaged after saving)."
        )
    if raw is None:
        raise ValueError(
            f"{filepath!r} is not a Keras model archive: it has no config.json (members: {names})."
        )
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{filepath!r}: config.json is not valid JSON: {e}") from e
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


def _restore_container_policies(model: keras.Model, config: dict) -> int:
    """Gives nested Sequential/functional models the dtype policy their config saved.

    `Sequential.from_config` (and a functional model's) ignores the saved `dtype`, so a
    converted model's nested blocks (ConvNeXt's stem and downsampling Sequentials) come
    back labelled with the global policy while their layers keep the saved one.

    Returns:
        How many nested models got their saved policy back.
    """
    restored = 0

    def walk(parent, parent_config):
        nonlocal restored
        sublayers = (parent_config.get("config") or {}).get("layers")
        if not isinstance(sublayers, list) or not hasattr(parent, "get_layer"):
            return
        for sub in sublayers:
            inner = sub.get("config") if isinstance(sub, dict) else None
            if not isinstance(inner, dict) or not isinstance(inner.get("name"), str):
                continue
            try:
                child = parent.get_layer(inner["name"])
            except ValueError:
                continue
            if not isinstance(child, keras.Model):
                continue
            saved = inner.get("dtype")
            if isinstance(saved, (dict, str)) and not isinstance(
                child.dtype_policy, keras.dtype_policies.DTypePolicyMap
            ):
                policy = keras.dtype_policies.get(saved)
                if policy.name != child.dtype_policy.name:
                    child.dtype_policy = policy
                    restored += 1
            walk(child, sub)

    walk(model, config)
    return restored


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
    parent's; float32 beside a float16 parent failed); nested
    Sequential and functional models then get back the dtype policy their config saved
    (Keras gives them the global one, while their layers keep the saved one).

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
    with sublayer_dtypes.scope():
        model = keras.models.load_model(
            filepath, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
        )
    if config is not None:
        _restore_container_policies(model, config)
    reapply_plan(model)
    return model


def reapply_plan(model: keras.Model) -> bool:
    """Gives a loaded `kmp.convert` model back what its saved policy map cannot hold.

    Keras resolves a `DTypePolicyMap` only for layers with a path, and a loaded keras_hub
    model rebuilds its blocks' sublayers as stock layers: the pins of path-less sublayers
    (the softmax inside a keras_hub `MultiHeadAttention`) and keras_mp's fused layer-norm and
    GELU kernels are not in the file. The map's default policy carries the keep-list, so
    the plan is made again on the loaded model and applied. Models not made by
    `kmp.convert` are left as they are.

    Args:
        model: A loaded model.

    Returns:
        True if the model was made by `kmp.convert` and the plan was applied.
    """
    import keras_mp.keep_list as keep_list
    import keras_mp.policies as policies
    from keras_mp.conversion.converter import apply_plan, saved_by_a_graph

    maps = [
        x.dtype_policy
        for x in model._flatten_layers(include_self=True)
        if isinstance(x, keras.Model)
        and isinstance(x.dtype_policy, keras.dtype_policies.DTypePolicyMap)
        and isinstance(x.dtype_policy.default_policy, policies.Policy)
    ]
    if not maps:
        return False
    layers, parents = keep_list.layer_tree(model)
    saved = [  # pins the file holds (in the map, or in a layer's own config) stay
        (x, "pinned in the saved model")
        for x in layers
        if x.path
        and x.compute_dtype == "float32"
        and not isinstance(x, keras.layers.InputLayer)
        # A layer neither in the map nor in a graph's config got the global policy from a
        # model that does not pass its dtype on (keras_hub's SmolLM3): not a saved pin.
        and (
            isinstance(x.dtype_policy, keras.dtype_policies.DTypePolicyMap)
            or saved_by_a_graph(x, parents, model)
        )
    ]
    # A pin of a layer's own math only (the run check's, calibration's tight pins) saved
    # its sublayers' low policies: it stays alone, so that sublayers without a path yet
    # (built by their first call, as keras_hub's RWKV-7 `TimeShift`) keep the low dtype.
    alone, keep = [], []
    for pin in saved:
        (alone if _pinned_alone(pin[0]) else keep).append(pin)
    pmap = maps[0]
    apply_plan(model, keep_list.plan(model, pmap.default_policy, keep=keep, exact=alone), pmap)
    return True


def _pinned_alone(layer: keras.layers.Layer) -> bool:
    """Whether a loaded float32 layer has a sublayer with a path in a low dtype."""
    inner = [x for x in layer._flatten_layers(include_self=False) if x.path]
    return any(x.compute_dtype != "float32" for x in inner)


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
