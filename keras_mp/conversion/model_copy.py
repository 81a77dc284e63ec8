"""Copying a built model, and carrying weights to their counterparts by identity.

`copy_model` gives a model's twin: its own layers and variables, same classes, same weights,
no compile state. It copies the objects the model is made of, so it needs no layer to
survive a `get_config()` round trip (several keras_hub layers do not); a model holding
something Python cannot copy is rebuilt from its config instead, and each weight carried to
its counterpart by path or, where paths differ, by the layer structure and the variable's
name. `recast_variables` changes variables' dtypes in place (for pure low-precision models).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import types

import keras
import numpy as np

from keras_mp.keras_glue.keras_internals import (
    DotNotTrackScope,
    DynamicBackend,
    Function,
    KerasSaveable,
    map_graph,
)
from keras_mp.numerics.recast import float32_statistics, own_variables, recast_variables

__all__ = ["copy_model", "float32_statistics", "pair_layers", "pair_variables", "recast_variables"]

_COPY_LOCK = threading.Lock()
# Trainer state a copy must not share or duplicate: the copy is compiled anew.
_COMPILE_STATE = (
    "optimizer",
    "loss",
    "_compile_loss",
    "_compile_metrics",
    "_loss_tracker",
    "_compile_config",
    "train_function",
    "test_function",
    "predict_function",
)


def _copy_saveable(self, memo):
    """`copy.deepcopy` of a Keras object as the objects it is made of.

    Keras' own `__reduce__` (what `copy.deepcopy` uses by default) saves the model to a
    buffer and loads it back: a `get_config()` round trip of every layer. This copies the
    instance's state instead, and gives the copy its own `build`/`quantize` wrappers (made
    by `Layer.__new__` around the instance they belong to).
    """
    cls = type(self)
    new = cls.__new__(cls)
    memo[id(self)] = new
    own = vars(new)
    for key, value in vars(self).items():
        wrapped = getattr(value, "__wrapped__", None)
        if key in own and getattr(wrapped, "__self__", None) is self:
            continue  # build_wrapper / quantize_wrapper of the original instance
        if isinstance(value, types.MethodType) and value.__self__ is self:
            own[key] = types.MethodType(value.__func__, new)
        else:
            own[key] = copy.deepcopy(value, memo)
    return new


@contextlib.contextmanager
def _objects_copied():
    """Within: `copy.deepcopy` copies Keras objects as objects (see `_copy_saveable`)."""
    with _COPY_LOCK, DotNotTrackScope():  # tracked lists/dicts are copied as they are
        KerasSaveable.__deepcopy__ = _copy_saveable
        # A module kept as an attribute is shared, as functions and classes are; the
        # backend switch of Keras' preprocessing layers is made anew.
        copy._deepcopy_dispatch[types.ModuleType] = copy._deepcopy_atomic
        copy._deepcopy_dispatch[DynamicBackend] = _copy_dynamic_backend
        try:
            yield
        finally:
            del KerasSaveable.__deepcopy__
            del copy._deepcopy_dispatch[types.ModuleType]
            del copy._deepcopy_dispatch[DynamicBackend]


def _copy_dynamic_backend(value: DynamicBackend, memo: dict) -> DynamicBackend:
    return DynamicBackend(value._backend)


def _deepcopy(model: keras.Model) -> keras.Model:
    memo: dict = {}
    for name in _COMPILE_STATE:
        value = model.__dict__.get(name)
        if value is not None and not isinstance(value, (bool, int, float, str)):
            memo[id(value)] = None
    strategy = model.__dict__.get("_distribute_strategy")
    if strategy is not None:
        memo[id(strategy)] = strategy  # shared, never copied
    limit = sys.getrecursionlimit()
    # deepcopy recurses along the layer graph, ~25 frames a layer: ConvNeXt-Tiny needs
    # 3,000, a chain of 3,000 Dense layers 100,000 (CPython 3.11+ keeps these frames off
    # the C stack).
    sys.setrecursionlimit(max(limit, 100_000 if sys.version_info >= (3, 11) else 10_000))
    try:
        with _objects_copied():
            new = copy.deepcopy(model, memo)
    finally:
        sys.setrecursionlimit(limit)
    _renew_ids(memo)
    return _uncompiled(new)


def _renew_ids(memo: dict) -> None:
    """Rewrites what the copied objects keep of their originals' `id`s: the trackers' sets
    of tracked ids (Keras), sets of layer ids (keras_hub), a Function's node keys."""
    copies = {k: v for k, v in memo.items() if k != id(memo) and v is not None}
    for obj in list(copies.values()):
        if isinstance(obj, set) and obj and all(isinstance(i, int) for i in obj):
            if any(i in copies for i in obj):
                renewed = {id(copies[i]) if i in copies else i for i in obj}
                obj.clear()
                obj.update(renewed)
        elif isinstance(obj, Function):  # its node keys are made of its layers' ids
            object.__setattr__(obj, "_nodes", map_graph(obj._inputs, obj._outputs)[0])


def _uncompiled(new: keras.Model) -> keras.Model:
    if getattr(new, "compiled", False):
        new.compiled = False
        for name in _COMPILE_STATE:
            if name in new.__dict__:
                object.__setattr__(new, name, None)
    return new


def _rebuild(model: keras.Model) -> keras.Model:
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    new = keras.saving.deserialize_keras_object(config)
    for a, b in pair_variables(model, new):
        # Through numpy: a fresh buffer (JAX donates a training model's buffers).
        b.assign(keras.ops.cast(np.asarray(keras.ops.convert_to_numpy(a.value)), b.dtype))
    return new


def copy_model(model: keras.Model) -> tuple[keras.Model, bool]:
    """A twin of a built `model`: own layers and variables, same weights, not compiled.

    Args:
        model: A built Keras model.

    Returns:
        `(twin, copied)`: `copied` is True when the model was copied as objects (every
        layer keeps its path), False when it had to be rebuilt from its config.

    Raises:
        ValueError: when the model can be neither copied nor rebuilt (both reasons given).
    """
    try:
        return _deepcopy(model), True
    except Exception as copy_error:  # noqa: BLE001 - e.g. a lock or a generator inside
        try:
            return _rebuild(model), False
        except Exception as e:
            raise ValueError(
                f"model {model.name!r} ({type(model).__name__}) could not be copied "
                f"({type(copy_error).__name__}: {copy_error}) nor rebuilt from its config "
                f"({type(e).__name__}: {e})."
            ) from e


def _walk(old, new, pairs: list, unmatched: list, where: str, layers: list) -> None:
    """Pairs `old`'s and `new`'s own variables, then their children, recursively."""
    layers.append((old, new))
    own_old, own_new = own_variables(old), own_variables(new)
    names_old, names_new = [v.name for v in own_old], [v.name for v in own_new]
    if len(set(names_old)) == len(names_old) and sorted(names_old) == sorted(names_new):
        by_name = {v.name: v for v in own_new}
        pairs += [(v, by_name[v.name]) for v in own_old]
    elif len(own_old) == len(own_new):
        pairs += list(zip(own_old, own_new, strict=True))
    else:
        unmatched.append(f"{where}: {len(own_old)} vs {len(own_new)} variables")
    kids_old = [c for c in getattr(old, "_layers", []) if isinstance(c, keras.layers.Layer)]
    kids_new = [c for c in getattr(new, "_layers", []) if isinstance(c, keras.layers.Layer)]
    names_old = [c.name for c in kids_old]
    if len(set(names_old)) == len(names_old) and sorted(names_old) == sorted(
        c.name for c in kids_new
    ):
        by_name = {c.name: c for c in kids_new}
        kid_pairs = [(c, by_name[c.name]) for c in kids_old]
    elif [type(c).__name__ for c in kids_old] == [type(c).__name__ for c in kids_new]:
        kid_pairs = list(zip(kids_old, kids_new, strict=True))
    else:
        unmatched.append(f"{where}: sublayers {names_old} vs {[c.name for c in kids_new]}")
        return
    for a, b in kid_pairs:
        _walk(a, b, pairs, unmatched, f"{where}/{a.name}", layers)


def pair_layers(model: keras.Model, new: keras.Model) -> list:
    """`(layer of model, layer of new)` pairs, walking both layer trees (see `pair_variables`).

    Args:
        model: The source model.
        new: A model of the same architecture.

    Returns:
        A list of pairs, `model` and `new` themselves excluded.
    """
    layers: list = []
    _walk(model, new, [], [], model.name, layers)
    return layers[1:]


def pair_variables(model: keras.Model, new: keras.Model) -> list:
    """Pairs every variable of `model` with its counterpart in `new`, by identity.

    By path where both models have the same set of unique variable paths; otherwise by
    walking both layer trees (children by name, or by position where names differ but
    classes line up) and pairing each layer's own variables by name (by position only where
    a layer's variable names repeat). Never by position in `model.weights`.

    Args:
        model: The source model.
        new: A model of the same architecture (e.g. rebuilt from `model`'s config).

    Returns:
        A list of `(variable of model, variable of new)`.

    Raises:
        ValueError: naming the variables or layers without a counterpart, or the pairs whose
            shapes differ.

    Example:

    ```python
    twin = keras.models.clone_model(model)
    for a, b in kmp.model_copy.pair_variables(model, twin):
        b.assign(a)
    ```
    """
    old_vars, new_vars = model.weights, new.weights
    old_paths, new_paths = [v.path for v in old_vars], [v.path for v in new_vars]
    if len(set(old_paths)) == len(old_paths) and sorted(old_paths) == sorted(new_paths):
        by_path = {v.path: v for v in new_vars}
        pairs = [(v, by_path[v.path]) for v in old_vars]
    else:
        pairs, unmatched = [], []
        _walk(model, new, pairs, unmatched, model.name, [])
        seen_old, seen_new = {id(a) for a, _ in pairs}, {id(b) for _, b in pairs}
        unmatched += [f"{v.path} (source)" for v in old_vars if id(v) not in seen_old]
        unmatched += [f"{v.path} (copy)" for v in new_vars if id(v) not in seen_new]
        if unmatched:
            raise ValueError(
                f"the weights of {model.name!r} and its rebuilt copy do not line up; "
                f"unmatched: {unmatched[:5]}{' ...' if len(unmatched) > 5 else ''}."
            )
    bad = [(a.path, tuple(a.shape), tuple(b.shape)) for a, b in pairs if a.shape != b.shape]
    if bad:
        raise ValueError(
            f"the weights of {model.name!r} and its rebuilt copy differ in shape: "
            f"{bad[:3]} (path, source shape, copy shape)."
        )
    return pairs
