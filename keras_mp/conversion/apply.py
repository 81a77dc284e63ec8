"""Applying a plan to a model in place: every layer's dtype policy, then keras_mp's layer
versions and the casts at boundaries.

`apply_plan` is what `convert` does to its copy (and `in_place`, to the model itself), and
what `kmp.saving.load_model` does again to a loaded model.
"""

from __future__ import annotations

import re

import keras

import keras_mp.keep_list as keep_list
from keras_mp.conversion.boundary import (
    cast_at_boundaries,
    cast_model_outputs,
    keep_index_inputs,
)
from keras_mp.keras_glue.keras_internals import DotNotTrackScope
from keras_mp.policies import Policy

__all__ = ["apply_plan", "saved_by_a_graph"]


def saved_by_a_graph(layer, parents: dict, model: keras.Model) -> bool:
    """Whether `layer`'s dtype is saved in its own config, by a Functional/Sequential model
    that lists its layers and is saved itself (rather than by a keras_hub model's or
    subclass's map: a `keras.Sequential` head that a keras_hub task makes in its constructor
    is made anew on loading, not read from the file)."""
    if isinstance(layer, keras.Model) and not keep_list.serializes_its_layers(layer):
        return False  # it saves its own dtype, which must carry the map
    container = parents.get(id(layer))
    while container is not None and not isinstance(container, keras.Model):
        container = parents.get(id(container))
    container = model if container is None else container
    if not keep_list.serializes_its_layers(container):
        return False
    return container is model or saved_by_a_graph(container, parents, model)


def apply_plan(model: keras.Model, the_plan: keep_list.Plan, pmap) -> None:
    """Runs `model` under `the_plan` in place: policies, then keras_mp layer versions.

    A layer inside a Functional/Sequential model whose config lists its layers (a graph
    node, or a sublayer of one) gets a plain policy (float32 or the base), which the node's
    config saves. Every other layer with a path (in a keras_hub model, whose config saves
    only the model's dtype, or in a subclassed model) gets `pmap`, resolved by its path:
    where a key misses, an exact one is added; so does such a model itself. Layers without a
    path, which Keras does not resolve through a map, get their policy directly. Then the
    plan's swaps, keras_mp's layer norm and GELU kernels (same state, config and math), and
    the casts of low sublayers' outputs to float32 inside a layer pinned alone, and of the
    model's outputs (and those of the models a subclassed model calls) to float32
    (`keras_mp.conversion.boundary`).
    """
    policy = the_plan.policy
    float32, base = keras.DTypePolicy("float32"), keras.DTypePolicy(policy.base.name)
    layers, parents = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    model._dtype_policy = pmap  # keras_hub saves it; the compile hook reads it

    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer):
            # It computes nothing, but reports a dtype: a model built under Keras' global
            # "mixed_float16" would otherwise still say float16 there after converting.
            layer._dtype_policy = base
            continue
        if layer.quantization_mode is not None:
            continue
        # A nested Functional/Sequential container computes nothing itself (its layers
        # decide), but it reports a dtype: the base one unless pinned, as in stock Keras.
        want = float32 if where.get(id(layer)) in the_plan.float32 else base
        if not layer.path or saved_by_a_graph(layer, parents, model):
            layer._dtype_policy = want
            continue
        layer._dtype_policy = pmap  # the public setter would write into a shared map
        if re.escape(layer.path) in pmap._policy_map:
            continue  # its own key: the plan's, or the saved model's (a loaded pin)
        if pmap[layer.path].compute_dtype != want.compute_dtype:
            pmap[re.escape(layer.path)] = want
    if policy.is_low_precision:
        _swap_layers(layers, where, the_plan, policy)
    _restate_normalization(layers)
    cast_at_boundaries(layers, parents)
    keep_index_inputs(layers, parents)
    cast_model_outputs(model, layers, parents, policy.is_low_precision)


def _restate_normalization(layers) -> None:
    """Keras' `Normalization` keeps its mean and variance as tensors cast to the compute
    dtype it had when adapted or built: cast them to the one it has now."""
    for layer in layers:
        if not isinstance(layer, keras.layers.Normalization) or not layer.built:
            continue
        for name in ("mean", "variance"):
            value = getattr(layer, name, None)
            if value is not None:
                with DotNotTrackScope():
                    setattr(layer, name, keras.ops.cast(value, layer.compute_dtype))


def _track_after_dropout(attention, softmax) -> None:
    """Puts the softmax where a built `keras_mp.layers.MultiHeadAttention` tracks it."""
    tracked, dropout = attention._layers, getattr(attention, "_dropout_layer", None)
    if dropout is None or dropout not in tracked:
        return
    with DotNotTrackScope():
        tracked.remove(softmax)
        tracked.insert(tracked.index(dropout) + 1, softmax)


def _swap_layers(layers, where: dict, the_plan: keep_list.Plan, policy: Policy) -> None:
    import keras_mp.numerics.activations as activations
    import keras_mp.numerics.layers as kmp_layers

    fast_norm = "normalization" in policy.keep_fp32
    for layer in layers:
        swap = the_plan.swaps.get(where[id(layer)])
        if swap == "keras_mp.layers.Softmax" and type(layer) is keras.layers.Softmax:
            layer.__class__ = kmp_layers.Softmax
        elif swap == "keras_mp.layers.MultiHeadAttention":
            if type(layer) is keras.layers.MultiHeadAttention:
                layer.__class__ = kmp_layers.MultiHeadAttention
                softmax = getattr(layer, "_softmax", None)
                if type(softmax) is keras.layers.Softmax:
                    softmax.__class__ = kmp_layers.Softmax
                    _track_after_dropout(layer, softmax)
        elif fast_norm and type(layer) is keras.layers.LayerNormalization:
            if layer.compute_dtype != "float32":
                layer.__class__ = kmp_layers.LayerNormalization
        if getattr(layer, "activation", None) is keras.activations.gelu:
            layer.activation = activations.gelu
