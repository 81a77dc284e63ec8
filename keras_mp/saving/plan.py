"""A loaded `kmp.convert` model gets back what its file cannot hold: the precision plan.

`kmp.convert` gives a model a `DTypePolicyMap` whose default is a `kmp.Policy` (the policy
and its keep-list), and makes decisions that live on the model's objects, not in any
config: the float32 casts at a pinned block's boundary and of the model's outputs, the
graph nodes that take token ids uncast (`keras_mp.conversion.boundary`), keras_mp's fused
layer norm and GELU. On load they are made again from the map (`reapply_plan`).

Keras saves that map only for models whose config carries their `dtype` (keras_hub's,
subclassed ones): `Functional.get_config` writes no `dtype`, and `Sequential.from_config`
ignores the one it writes. So a converted Functional model came back from its file with
plain per-layer policies and nothing to say it was converted: its ids were rounded to
bfloat16 again under `"lean_bfloat16"` (1999 became 2000, past a 2000-row table), and its
outputs were no longer float32. `install()` closes that:

- `Functional.get_config` writes the model's `dtype` when it is a keras_mp plan (a map
  whose default is a `kmp.Policy`); other models' configs are unchanged;
- `Model.from_config` (Functional and subclassed models) and `Sequential.from_config` make
  the model's layers with the plan's base policy as the global one, so that a layer whose
  `get_config` omits its `dtype` (the keras.io subclassing guide's first version) and the
  sublayers it makes in `__init__` load in the dtype `convert` gave them, not in float32
  (under `"lean_bfloat16"` its float32 variables no longer matched the saved optimizer
  state); then they give the model the map its config saved, nested Sequential/Functional
  models the policy theirs saved, and the outermost model its plan again (`reapply_plan`).

`keras_mp.saving.sublayer_dtypes.install()` installs it (so `import keras_mp` does: plain
`keras.saving.load_model` gets the plan back); `kmp.saving.load_model` and
`kmp.saving.save_model` use `scope()`, so they work with `KERAS_MP_NO_PATCH=1` too.
"""

from __future__ import annotations

import functools
import threading
import weakref

import keras

from keras_mp.keras_glue.keras_internals import Functional, Sequential
from keras_mp.keras_glue.scoped import installed_for_block

__all__ = [
    "applied",
    "install",
    "installed",
    "reapply_plan",
    "restore_container_policies",
    "saved_plan",
    "scope",
    "uninstall",
]

_FLAG = "_keras_mp_load_plan"
_depth = threading.local()
_applied: weakref.WeakSet = weakref.WeakSet()  # models whose from_config reapplied the plan


def _is_plan(policy) -> bool:
    from keras_mp.policies import Policy

    return isinstance(policy, keras.dtype_policies.DTypePolicyMap) and isinstance(
        policy.default_policy, Policy
    )


def applied(model: keras.Model) -> bool:
    """Whether `model` got its plan back while it was made from its config."""
    return model in _applied


def saved_plan(config) -> keras.dtype_policies.DTypePolicyMap | None:
    """The keras_mp plan (`DTypePolicyMap`) a model's config saved as its `dtype`, or None."""
    saved = config.get("dtype") if isinstance(config, dict) else None
    if not isinstance(saved, dict):
        return None
    try:
        policy = keras.dtype_policies.get(saved)
    except (TypeError, ValueError):
        return None
    return policy if _is_plan(policy) else None


def restore_container_policies(model: keras.Model, config: dict) -> int:
    """Gives `model` and its nested Sequential/Functional models the dtype policy their
    config saved.

    `Sequential.from_config` (and a functional model's) ignores the saved `dtype`, so a
    converted model's nested blocks (ConvNeXt's stem and downsampling Sequentials) come
    back labelled with the global policy while their layers keep the saved one.

    Args:
        model: The model made from `config`.
        config: Its serialized form (`{"class_name": ..., "config": {...}}`).

    Returns:
        How many models got their saved policy back.
    """
    restored = 0

    def give(child, saved) -> None:
        nonlocal restored
        if not isinstance(saved, (dict, str)) or isinstance(
            child.dtype_policy, keras.dtype_policies.DTypePolicyMap
        ):
            return
        policy = keras.dtype_policies.get(saved)
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            child._dtype_policy = policy  # the public setter would write into the map
            restored += 1
        elif policy.name != child.dtype_policy.name:
            child.dtype_policy = policy
            restored += 1

    def walk(parent, parent_config):
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
            give(child, inner.get("dtype"))
            walk(child, sub)

    inner = config.get("config") if isinstance(config, dict) else None
    if isinstance(inner, dict) and _is_plan(saved_plan(inner)):
        give(model, inner["dtype"])
    walk(model, config)
    return restored


def reapply_plan(model: keras.Model) -> bool:
    """Gives a loaded `kmp.convert` model back what its saved policy map cannot hold.

    Keras resolves a `DTypePolicyMap` only for layers with a path, and a loaded keras_hub
    model rebuilds its blocks' sublayers as stock layers: the pins of path-less sublayers
    (the softmax inside a keras_hub `MultiHeadAttention`), keras_mp's fused layer-norm and
    GELU kernels, the casts at pinned blocks' boundaries and of the model's outputs, and
    the graph nodes that take token ids uncast are not in the file. The map's default
    policy carries the keep-list, so the plan is made again on the loaded model and
    applied. Models not made by `kmp.convert` are left as they are.

    Args:
        model: A loaded model.

    Returns:
        True if the model was made by `kmp.convert` and the plan was applied.
    """
    import keras_mp.keep_list as keep_list
    from keras_mp.conversion.converter import apply_plan, saved_by_a_graph

    maps = [
        x.dtype_policy
        for x in model._flatten_layers(include_self=True)
        if isinstance(x, keras.Model) and _is_plan(x.dtype_policy)
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


def _wrap_get_config(inherited):
    @functools.wraps(inherited)
    def get_config(self):
        config = inherited(self)
        if isinstance(config, dict) and "dtype" not in config and _is_plan(self.dtype_policy):
            config["dtype"] = keras.dtype_policies.serialize(self.dtype_policy)
        return config

    setattr(get_config, _FLAG, True)
    return get_config


def _wrap_from_config(inherited):
    @functools.wraps(inherited)
    def from_config(cls, config, custom_objects=None):
        original = {"config": dict(config)} if isinstance(config, dict) else None
        plan = saved_plan(config)
        previous = keras.config.dtype_policy()
        if plan is not None:  # what `convert` gave a layer that is not pinned
            keras.config.set_dtype_policy(plan.default_policy.base)
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            model = inherited(cls, config, custom_objects=custom_objects)
        finally:
            _depth.n -= 1
            keras.config.set_dtype_policy(previous)
        if original is None or not isinstance(model, keras.Model):
            return model
        restore_container_policies(model, original)
        if _depth.n == 0 and reapply_plan(model):
            _applied.add(model)
        return model

    setattr(from_config, _FLAG, True)
    return from_config


def _own(cls, name):
    return vars(cls).get(name)


_TARGETS = (
    (Functional, "get_config", False),
    (keras.Model, "from_config", True),
    (Sequential, "from_config", True),
)


def installed() -> bool:
    """Whether configs save a converted Functional model's plan and loads restore it."""
    for cls, name, is_class in _TARGETS:
        method = _own(cls, name)
        func = method.__func__ if is_class else method
        if not getattr(func, _FLAG, False):
            return False
    return True


def install() -> None:
    """Wraps `Functional.get_config` and `Model`/`Sequential.from_config` (see the module's
    docstring); idempotent."""
    for cls, name, is_class in _TARGETS:
        method = _own(cls, name)
        func = method.__func__ if is_class else method
        if getattr(func, _FLAG, False):
            continue
        if is_class:
            setattr(cls, name, classmethod(_wrap_from_config(func)))
        else:
            setattr(cls, name, _wrap_get_config(func))


def uninstall() -> None:
    """Gives Keras back its own `get_config`/`from_config`; idempotent."""
    for cls, name, is_class in _TARGETS:
        method = _own(cls, name)
        func = method.__func__ if is_class else method
        if getattr(func, _FLAG, False):
            inherited = func.__wrapped__
            setattr(cls, name, classmethod(inherited) if is_class else inherited)


def scope():
    """`install()` for the duration of a `with` block (nothing to do if installed)."""
    return installed_for_block(install, uninstall, installed)
