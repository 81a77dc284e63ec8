"""Implementation of `keras_mp.convert`: rebuild a model under a `Policy`, weights carried over."""

from __future__ import annotations

import warnings

import keras
from keras.src.models.functional import Functional  # what keras.models.clone_model uses

from keras_mp.policies import DEFAULT_KEEP_FP32, Policy, _entry_matches, _output_layers

__all__ = ["convert_model"]


def _swaps(policy: Policy) -> dict:
    """Stock classes replaced by their keras_mp versions (FP32 softmax, fused layer norm)."""
    if not policy.is_low_precision:
        return {}
    try:
        from keras_mp import layers as kmp_layers
    except ImportError:  # keras_mp.layers not there: the stock softmax sublayers are pinned
        return {}
    swaps = {}
    if "attention" in policy.keep_fp32 and hasattr(kmp_layers, "MultiHeadAttention"):
        swaps[keras.layers.MultiHeadAttention] = kmp_layers.MultiHeadAttention
    if "softmax" in policy.keep_fp32 and hasattr(kmp_layers, "Softmax"):
        swaps[keras.layers.Softmax] = kmp_layers.Softmax
    if "normalization" in policy.keep_fp32 and hasattr(kmp_layers, "LayerNormalization"):
        swaps[keras.layers.LayerNormalization] = kmp_layers.LayerNormalization
    return swaps


def _fast_activations(model: keras.Model, policy: Policy) -> None:
    """Gives layers whose activation is Keras' GELU `keras_mp.activations.gelu` (same math;
    on TensorFlow outside XLA a float32-math kernel for low-precision tensors)."""
    if not policy.is_low_precision:
        return
    from keras_mp.activations import gelu

    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, "activation", None) is keras.activations.gelu:
            layer.activation = gelu


def _pairs(orig, new, swaps: dict):
    """(original, converted) sublayer pairs, recursively; original is None when unmatched.

    Children are matched by position when their classes line up, else by name. keras_mp
    layers manage their own precision, so their sublayers are not visited.
    """
    if type(new).__module__.startswith("keras_mp."):
        return
    o_children = getattr(orig, "_layers", [])
    n_children = getattr(new, "_layers", [])
    if [swaps.get(type(c), type(c)) for c in o_children] == [type(c) for c in n_children]:
        pairs = list(zip(o_children, n_children, strict=True))
    else:
        by_name = {c.name: c for c in o_children}
        pairs = [(by_name.get(c.name), c) for c in n_children]
    for o, n in pairs:
        yield o, n
        yield from _pairs(o, n, swaps)


def _pin(pairs, policy: Policy, outputs: list, built: bool) -> None:
    for o, n in pairs:
        if isinstance(n, (keras.Model, keras.layers.InputLayer)):
            continue
        target = policy.for_layer(o if o is not None else n, outputs)
        if (n.compute_dtype, n.variable_dtype) == (target.compute_dtype, target.variable_dtype):
            continue
        n.dtype_policy = target
        own = n._trainable_variables + n._non_trainable_variables
        if built and any(v.dtype != target.variable_dtype for v in own):
            warnings.warn(
                f"convert: layer {n.path or n.name!r} computes in {target.compute_dtype} but "
                f"its variables were created in {own[0].dtype} (a sublayer made in build() "
                f"under a pure {policy.name!r} policy).",
                UserWarning,
                stacklevel=3,
            )


def _clone_subclassed(model: keras.Model, policy: Policy, outputs: list, swaps: dict):
    try:
        config = model.get_config()
        if "dtype" in config:
            config["dtype"] = policy.base
        new = model.__class__.from_config(config)
    except Exception as e:
        raise ValueError(
            f"convert() rebuilds subclassed models through get_config()/from_config(), which "
            f"failed for {type(model).__name__!r}: {e}. Give the class a get_config() that "
            "returns its constructor arguments, or build the model with the Functional API."
        ) from e
    _pin(_pairs(model, new, swaps), policy, outputs, built=False)
    new.build_from_config(model.get_build_config())
    if model.compiled:
        new.compile_from_config(model.get_compile_config())
    return new


def _copy_weights(model: keras.Model, new: keras.Model) -> None:
    old_w, new_w = model.weights, new.weights
    shapes = [tuple(w.shape) for w in old_w], [tuple(w.shape) for w in new_w]
    if shapes[0] != shapes[1]:
        bad = [o.path for o, n in zip(old_w, new_w, strict=False) if o.shape != n.shape]
        raise ValueError(
            f"convert: the rebuilt model's weights do not line up with {model.name!r}'s "
            f"({len(old_w)} vs {len(new_w)} variables; first mismatch: "
            f"{bad[0] if bad else 'at the end'})."
        )
    for o, n in zip(old_w, new_w, strict=True):
        # Through numpy: a fresh buffer (JAX donates a training model's buffers, so sharing
        # one with the original would delete the original's weights).
        n.assign(keras.ops.cast(keras.ops.convert_to_numpy(o.value), n.dtype))


def _warn_unmatched(model: keras.Model, policy: Policy, outputs: list) -> None:
    """Warns about user-added keep-list entries that match no layer (likely a typo)."""
    ids = frozenset(id(x) for x in outputs)
    layers = model._flatten_layers(include_self=False)
    unmatched = [
        e
        for e in policy.keep_fp32
        if e not in DEFAULT_KEEP_FP32 and not any(_entry_matches(e, x, ids) for x in layers)
    ]
    if unmatched and policy.is_low_precision:
        warnings.warn(
            f"keep_fp32 entries {unmatched} match no layer of model {model.name!r}.",
            UserWarning,
            stacklevel=3,
        )


def convert_model(model: keras.Model, policy: Policy) -> keras.Model:
    """Implementation of `keras_mp.convert` (see there)."""
    if not isinstance(model, keras.Model):
        raise ValueError(f"convert() takes a keras.Model. Received: {type(model).__name__}")
    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built: call it on data or use model.build(shape) "
            "before convert(), so that there are weights to carry over."
        )
    outputs = _output_layers(model)
    swaps = _swaps(policy)
    _warn_unmatched(model, policy, outputs)

    def clone_layer(layer):
        if not isinstance(layer, keras.layers.Layer):  # a keras.ops operation in the graph
            return layer.__class__.from_config(layer.get_config())
        cls = swaps.get(type(layer), type(layer))
        try:
            config = layer.get_config()
            config["dtype"] = policy.for_layer(layer, outputs)
            new = cls.from_config(config)
        except Exception as e:
            raise ValueError(
                f"convert: layer {layer.name!r} ({type(layer).__name__}) could not be rebuilt "
                f"from its get_config(): {e}"
            ) from e
        _pin(_pairs(layer, new, swaps), policy, outputs, built=False)
        return new

    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy.base)  # sublayers created without dtype= get it
    try:
        if isinstance(model, (Functional, keras.Sequential)):
            new = keras.models.clone_model(model, clone_function=clone_layer, recursive=True)
        else:
            new = _clone_subclassed(model, policy, outputs, swaps)
    finally:
        keras.config.set_dtype_policy(previous)
    _pin(_pairs(model, new, swaps), policy, outputs, built=True)
    _fast_activations(new, policy)
    _copy_weights(model, new)
    return new
