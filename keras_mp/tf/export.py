"""SavedModel export with a full-precision serving signature (TensorFlow backend).

Stock `model.export()` traces the model with its own input dtypes and returns whatever
the last layer computes, so a model trained under `mixed_float16` serves float16
tensors. `export_saved_model` wraps the model in an endpoint that takes and returns
`serving_dtype` (float32 by default) and, with `compute="float32"`, serves an FP32 clone
with the same weights (for CPUs, where float16 is slow). It uses Keras' own
`keras.export.ExportArchive`; the artifact needs only TensorFlow to load.

TensorFlow is imported inside the functions, so importing this module (and keras_mp)
never imports TensorFlow on the JAX backend.
"""

from __future__ import annotations

import os
from typing import Any

import keras
from keras import ops, tree

from keras_mp.keras_glue.extras import require
from keras_mp.keras_glue.quiet import ignoring

__all__ = ["export_saved_model", "float32_clone", "writing_a_saved_model"]

_SERVING_DTYPES = ("float32", "float16", "bfloat16", "float64")
_COMPUTE = ("mixed", "float32")
_ENDPOINT = "serve"


def writing_a_saved_model() -> bool:
    """Whether TensorFlow is tracing functions into a SavedModel being written (`model.export`,
    `tf.saved_model.save`, and so `tf.lite.TFLiteConverter.from_keras_model`, which exports
    first). keras_mp's training kernels (XLA clusters, loops over blocks of rows) take the
    plain ops there: a serving graph must run without XLA, and TFLite cannot lower them."""
    from tensorflow.python.saved_model import save_context

    return save_context.in_save_context()


def _is_float(dtype: Any) -> bool:
    return dtype is not None and "float" in keras.backend.standardize_dtype(dtype)


def _is_policy_config(obj: Any) -> bool:
    """True for a serialized DTypePolicy / DTypePolicyMap (any package)."""
    if not (isinstance(obj, dict) and "class_name" in obj and "config" in obj):
        return False
    name = obj.get("registered_name")
    if name:
        cls = keras.saving.get_registered_object(name)
    else:  # a built-in Keras class, serialized without a registered name
        cls = getattr(keras.dtype_policies, str(obj["class_name"]), None)
    return isinstance(cls, type) and issubclass(
        cls, (keras.DTypePolicy, keras.dtype_policies.DTypePolicyMap)
    )


def _strip_policies(config: Any) -> Any:
    """A copy of a serialized config with every dtype policy replaced by "float32"."""
    if isinstance(config, dict):
        out = {}
        for key, value in config.items():
            if key == "dtype" and _is_policy_config(value):
                out[key] = "float32"
            else:
                out[key] = _strip_policies(value)
        return out
    if isinstance(config, (list, tuple)):
        return type(config)(_strip_policies(v) for v in config)
    return config


def float32_clone(model: keras.Model) -> keras.Model:
    """An FP32 copy of `model`: same architecture and weights, every layer in float32.

    Every dtype policy in the model's config (Keras or keras_mp, including policy maps)
    is replaced by `"float32"`; the clone is rebuilt from that config (not compiled) and
    each of its variables receives the value of the variable with the same path in
    `model`, cast to the clone's dtype (so a pure-float16 model's weights are widened).

    Args:
        model: A built Keras model.

    Returns:
        A new, uncompiled `keras.Model` computing in float32.

    Example:

    >>> fp32 = float32_clone(mixed_model)  # doctest: +SKIP
    >>> fp32.layers[-1].compute_dtype  # doctest: +SKIP
    'float32'
    """
    if not model.built:
        raise ValueError(
            f"float32_clone: model {model.name!r} is not built; call it on data or build() it."
        )
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    config = _strip_policies(config)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        with ignoring(UserWarning):
            clone = keras.saving.deserialize_keras_object(config)
    finally:
        keras.config.set_dtype_policy(previous)
    _copy_values(model, clone)
    return clone


def _own_variables(layer: keras.layers.Layer) -> list:
    return list(layer._trainable_variables) + list(layer._non_trainable_variables)


def _copy_values(source: keras.Model, target: keras.Model) -> None:
    """Copies values layer by layer (same walk order), variable by variable name.

    Paths are not used: layers rebuilt from a config outside their model's name scope
    get shorter paths. Source variables the clone lacks (e.g. FP8 scaling state) are
    ignored; a clone variable without a source raises.
    """
    sources = list(source._flatten_layers(include_self=True))
    targets = list(target._flatten_layers(include_self=True))
    if [type(x) for x in sources] != [type(x) for x in targets]:
        raise ValueError(
            f"float32_clone: the layers rebuilt from the config of model {source.name!r} "
            "differ from the model's own layers; is every layer's get_config() complete?"
        )
    for s_layer, t_layer in zip(sources, targets):
        by_name = {v.name: v for v in _own_variables(s_layer)}
        for t in _own_variables(t_layer):
            s = by_name.get(t.name)
            if s is None or tuple(s.shape) != tuple(t.shape):
                found = None if s is None else tuple(s.shape)
                raise ValueError(
                    f"float32_clone: variable {t.name!r} of layer {t_layer.name!r} "
                    f"(shape {tuple(t.shape)}) has no counterpart in model {source.name!r} "
                    f"(found shape: {found})."
                )
            t.assign(ops.cast(s.value, t.dtype))


def _serving_spec(spec: keras.InputSpec, serving_dtype: str) -> keras.InputSpec:
    dtype = serving_dtype if _is_float(spec.dtype) else spec.dtype
    return keras.InputSpec(shape=spec.shape, dtype=dtype, name=spec.name)


def export_saved_model(
    model: keras.Model,
    path: str | os.PathLike,
    serving_dtype: str = "float32",
    compute: str = "mixed",
    input_signature: Any = None,
    verbose: bool = False,
) -> keras.Model:
    """Export `model` as a SavedModel that takes and returns `serving_dtype`.

    The endpoint `serve` (also the `serving_default` signature) casts floating inputs
    from `serving_dtype` to the model's input dtypes, runs the model with
    `training=False` and casts every floating output to `serving_dtype`; integer
    inputs/outputs keep their dtype. The artifact loads with `tf.saved_model.load`,
    `keras.layers.TFSMLayer(path, call_endpoint="serve", dtype="float32")` (give the
    layer a float32 policy, or it casts its inputs to the global policy's compute
    dtype) or TF Serving, with no keras_mp installed.

    Args:
        model: A built Keras model (TensorFlow backend).
        path: Directory to write the SavedModel to.
        serving_dtype: Dtype of the signature's floating inputs and outputs: one of
            `"float32"` (default), `"float16"`, `"bfloat16"`, `"float64"`.
        compute: `"mixed"` serves the model as trained (its own policies, e.g. float16
            matmuls); `"float32"` serves an FP32 clone with the same weights (see
            `float32_clone`), the better choice on CPUs.
        input_signature: Optional input signature, as for `model.export`
            (`keras.InputSpec`s or `tf.TensorSpec`s, one per positional argument of
            the model's `call`); its floating dtypes are replaced by `serving_dtype`.
            Defaults to the one Keras infers from the model.
        verbose: Print the exported variables.

    Returns:
        The model that was exported (`model` itself, or its FP32 clone).

    Example:

    ```python
    kmp.export_saved_model(model, "/tmp/served", compute="float32")
    served = tf.saved_model.load("/tmp/served")
    y = served.serve(tf.constant(x, tf.float32))   # float32 in, float32 out
    ```
    """
    if serving_dtype not in _SERVING_DTYPES:
        raise ValueError(
            f"export_saved_model: invalid `serving_dtype`={serving_dtype!r}; "
            f"valid choices: {list(_SERVING_DTYPES)}."
        )
    if compute not in _COMPUTE:
        raise ValueError(
            f"export_saved_model: invalid `compute`={compute!r}; valid choices: {list(_COMPUTE)}."
        )
    require("tensorflow", "kmp.export_saved_model (a TensorFlow SavedModel)")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            "export_saved_model needs the TensorFlow backend (KERAS_BACKEND=tensorflow); "
            f"the current backend is {keras.backend.backend()!r}. On other backends use "
            "model.export(path, format='tf_saved_model')."
        )
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"export_saved_model: `model` must be a keras.Model, got {type(model).__name__}."
        )
    if not model.built:
        raise ValueError(
            f"export_saved_model: model {model.name!r} is not built; call it on data first."
        )
    from keras_mp.keras_glue.keras_internals import get_input_signature, make_input_spec

    if input_signature is None:
        input_signature = get_input_signature(model)
    else:
        import tensorflow as tf

        def as_spec(x):
            if isinstance(x, tf.TensorSpec):
                return keras.InputSpec(shape=tuple(x.shape), dtype=x.dtype.name, name=x.name)
            return make_input_spec(x)

        input_signature = tree.map_structure(as_spec, input_signature)
        if not isinstance(input_signature, (list, tuple)):
            input_signature = [input_signature]
    model_signature = input_signature
    serving_signature = tree.map_structure(
        lambda s: _serving_spec(s, serving_dtype), model_signature
    )
    served = model if compute == "mixed" else float32_clone(model)

    def serve(*args):
        args = tree.map_structure(
            lambda x, spec: ops.cast(x, spec.dtype) if _is_float(spec.dtype) else x,
            tuple(args),
            tuple(model_signature),
        )
        outputs = served(*args, training=False)
        return tree.map_structure(
            lambda y: ops.cast(y, serving_dtype) if _is_float(y.dtype) else y, outputs
        )

    archive = keras.export.ExportArchive()
    archive.track(served)
    archive.add_endpoint(_ENDPOINT, serve, input_signature=serving_signature)
    archive.write_out(os.fspath(path), verbose=verbose)
    return served
