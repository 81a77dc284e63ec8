"""Keras' private API (`keras.src.*`), reached from this one module.

Keras moves its internals between releases (3.16: `Trainer` became `BaseTrainer`, the mask
helpers left `keras.src.backend`, JAX's `nn` moved under `backend.jax.ops`). Every other
keras_mp module imports what it needs of them from here, so the next move is a change to
this file alone: each name is looked up where the newest Keras keeps it, then where the
older ones did.

The names are found when this module is imported (Keras has imported their modules by
then), except JAX's `nn`, found by `jax_nn()` where it is used (it imports JAX).

`check_version()` (called by `import keras_mp`) refuses a Keras outside the supported range
with one clear line.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

import keras

__all__ = [
    "SUPPORTED_KERAS",
    "BaseOptimizer",
    "DotNotTrackScope",
    "DynamicBackend",
    "Function",
    "Functional",
    "KerasSaveable",
    "Sequential",
    "StatelessScope",
    "Trainer",
    "check_version",
    "fit_epoch_iterator",
    "fit_input",
    "get_input_signature",
    "get_keras_mask",
    "global_state",
    "in_safe_mode",
    "in_stateless_scope",
    "initial_epoch",
    "jax_nn",
    "keras_version",
    "make_input_spec",
    "map_graph",
    "no_automatic_dependency_tracking",
    "reduce_weighted_values",
    "set_initial_epoch",
    "set_keras_mask",
    "stored_value",
    "update_metrics_variables",
    "symbolic_build",
    "track_optimizer_variables",
    "untracked_optimizer_variables",
]

# The Keras versions keras_mp is tested on: [oldest, first unsupported). Keep setup.cfg's
# `keras>=...,<...` and the README's "Supported Keras" line in step with it.
SUPPORTED_KERAS = ((3, 12), (3, 17))

# name -> where to find it, newest Keras first: "module:attribute" (attribute empty: the
# module itself).
_PLACES: dict[str, tuple[str, ...]] = {
    # 3.16: the backend-neutral trainer is `BaseTrainer`; `compile` is defined on it.
    "Trainer": ("keras.src.trainers.trainer:BaseTrainer", "keras.src.trainers.trainer:Trainer"),
    "BaseOptimizer": ("keras.src.optimizers.base_optimizer:BaseOptimizer",),
    "Functional": ("keras.src.models.functional:Functional",),
    "Sequential": ("keras.src.models.sequential:Sequential",),
    "DotNotTrackScope": ("keras.src.utils.tracking:DotNotTrackScope",),
    "no_automatic_dependency_tracking": (
        "keras.src.utils.tracking:no_automatic_dependency_tracking",
    ),
    "Function": ("keras.src.ops.function:Function",),
    "map_graph": ("keras.src.ops.function:map_graph",),
    "KerasSaveable": ("keras.src.saving.keras_saveable:KerasSaveable",),
    "DynamicBackend": ("keras.src.utils.backend_utils:DynamicBackend",),
    # 3.16: no longer re-exported by `keras.src.backend`.
    "get_keras_mask": (
        "keras.src.backend.common.masking:get_keras_mask",
        "keras.src.backend:get_keras_mask",
    ),
    "set_keras_mask": (
        "keras.src.backend.common.masking:set_keras_mask",
        "keras.src.backend:set_keras_mask",
    ),
    "reduce_weighted_values": ("keras.src.losses.loss:reduce_weighted_values",),
    "global_state": ("keras.src.backend.common.global_state:",),
    "StatelessScope": ("keras.src.backend.common.stateless_scope:StatelessScope",),
    "in_stateless_scope": ("keras.src.backend.common.stateless_scope:in_stateless_scope",),
    # 3.16 (keras PR 23642): `backend.jax.nn` moved to `backend.jax.ops.nn`.
    "jax_nn": ("keras.src.backend.jax.ops.nn:", "keras.src.backend.jax.nn:"),
    "get_input_signature": ("keras.src.export.export_utils:get_input_signature",),
    "make_input_spec": ("keras.src.export.export_utils:make_input_spec",),
    # None outside `deserialize_keras_object` (unless unsafe deserialization is enabled).
    "in_safe_mode": ("keras.src.saving.serialization_lib:in_safe_mode",),
}


def _find(name: str) -> Any:
    tried = []
    for place in _PLACES[name]:
        module_name, _, attribute = place.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            tried.append(module_name)
            continue
        if not attribute:
            return module
        if hasattr(module, attribute):
            return getattr(module, attribute)
        tried.append(place)
    raise ImportError(
        f"keras_mp needs Keras' internal `{name}`, which Keras {keras.__version__} keeps in "
        f"none of the places keras_mp knows ({', '.join(tried)}). keras_mp supports Keras "
        f'{_range()}: install one of those (`pip install "keras{_specifier()}"`).'
    )


def jax_nn() -> Any:
    """Keras' JAX `nn` backend module (imports JAX)."""
    return _find("jax_nn")


def keras_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of the installed Keras, or of `version`."""
    parts = (version or keras.__version__).split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _range() -> str:
    (a, b), (c, d) = SUPPORTED_KERAS
    return f"{a}.{b} to {c}.{d - 1}"


def _specifier() -> str:
    (a, b), (c, d) = SUPPORTED_KERAS
    return f">={a}.{b},<{c}.{d}"


def check_version(version: str | None = None) -> None:
    """Checks the Keras version against `SUPPORTED_KERAS` (called when keras_mp imports).

    A Keras older than the oldest supported raises an `ImportError` of one line naming the
    install command; a newer, untested one warns once (keras_mp goes on: each internal it
    cannot find then raises naming itself and the supported range).

    Args:
        version: a Keras version string (default: the installed one).
    """
    found = version or keras.__version__
    oldest, first_unsupported = SUPPORTED_KERAS
    v = keras_version(found)
    advice = f'pip install "keras{_specifier()}"'
    if v < oldest:
        raise ImportError(
            f"keras_mp {_range_note()} supports Keras {_range()}; this is Keras {found}, "
            f"which it cannot run on. Install a supported one: {advice}"
        )
    if v >= first_unsupported:
        warnings.warn(
            f"keras_mp {_range_note()} is tested on Keras {_range()}; this is Keras {found}. "
            f"If something fails, install a tested one: {advice}",
            stacklevel=2,
        )


def _range_note() -> str:
    from keras_mp.version import __version__

    return __version__


check_version()  # before any internal is looked up

Trainer = _find("Trainer")
BaseOptimizer = _find("BaseOptimizer")
Functional = _find("Functional")
Sequential = _find("Sequential")
DotNotTrackScope = _find("DotNotTrackScope")
no_automatic_dependency_tracking = _find("no_automatic_dependency_tracking")
Function = _find("Function")
map_graph = _find("map_graph")
KerasSaveable = _find("KerasSaveable")
DynamicBackend = _find("DynamicBackend")
get_keras_mask = _find("get_keras_mask")
set_keras_mask = _find("set_keras_mask")
reduce_weighted_values = _find("reduce_weighted_values")
global_state = _find("global_state")
StatelessScope = _find("StatelessScope")
in_stateless_scope = _find("in_stateless_scope")
get_input_signature = _find("get_input_signature")
make_input_spec = _find("make_input_spec")
in_safe_mode = _find("in_safe_mode")


def untracked_optimizer_variables(optimizer, exclude=()) -> list:
    """Variables `optimizer` keeps as plain attributes outside its `variables` (Nadam's
    `_u_product`, made in `build` while a wrapper's `build` has tracking off), in a fixed
    order; `exclude`: variables that are not its own (the model's)."""
    seen = {id(v) for v in list(optimizer.variables) + list(exclude)}
    out = []
    for name in sorted(optimizer.__dict__):
        value = optimizer.__dict__[name]
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, keras.Variable) and id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def track_optimizer_variables(optimizer, variables) -> None:
    """Appends `variables` to `optimizer.variables` (Keras' own `_track_variable`)."""
    for v in variables:
        optimizer._track_variable(v)


def update_metrics_variables(model, metrics_values, loss, x, y, y_pred, sample_weight):
    """Keras' JAX trainer's end of a train step: `(logs, metrics_values)` with the
    loss tracker and compiled metrics updated (`JAXTrainer._update_metrics_variables`)."""
    return model._update_metrics_variables(metrics_values, loss, x, y, y_pred, sample_weight)


def stored_value(variable):
    """`variable`'s value as stored, not autocast: the current stateless scope's, if that
    maps it, else the variable's own."""
    scope = global_state.get_global_attribute("stateless_scope")
    value = scope.get_current_value(variable) if scope is not None else None
    return variable._value if value is None else value


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the `fit` that is calling `on_train_begin` start at `epoch` (None: its own
    `initial_epoch`). Keras' `fit` reads `model._initial_epoch` right after
    `on_train_begin`, as Keras' own `BackupAndRestore` uses it."""
    model._initial_epoch = epoch


def initial_epoch(model) -> int | None:
    """What `set_initial_epoch` set (None where nothing did)."""
    return getattr(model, "_initial_epoch", None)


def fit_epoch_iterator(model) -> Any:
    """The epoch iterator of the `model.fit` call now running (a callback's caller), or
    None where none is found: `fit` keeps it in a local, `epoch_iterator`, whose
    `data_adapter` says what the input is (arrays, a `tf.data.Dataset`, a `PyDataset`,
    a generator) and how it is shuffled."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            return frame.f_locals.get("epoch_iterator")
        frame = frame.f_back
    return None


def fit_input(model) -> dict | None:
    """What the `model.fit` call now running trains on, or None where it is not found.

    Returns:
        `{"kind": the data adapter's class name ("ArrayDataAdapter", "TFDatasetAdapter",
        "PyDatasetAdapter", "GeneratorDataAdapter", ...), "shuffle": fit's `shuffle` for
        arrays (None for other inputs), "steps_per_epoch": fit's argument, "num_batches":
        the input's batches an epoch (None if unknown)}`.
    """
    iterator = fit_epoch_iterator(model)
    adapter = getattr(iterator, "data_adapter", None)
    if adapter is None:
        return None
    return {
        "kind": type(adapter).__name__,
        "shuffle": getattr(adapter, "_shuffle", None),
        "steps_per_epoch": getattr(iterator, "steps_per_epoch", None),
        "num_batches": getattr(adapter, "num_batches", None),
    }


def symbolic_build(model, data_batch) -> None:
    """Builds what `model`'s first training step would (its compiled metrics, loss) from
    the shapes of `data_batch`, without running it (Keras' `_symbolic_build`)."""
    model._symbolic_build(data_batch=data_batch)
