"""Running a converted model the way training runs it, to see whether it can.

`sample_inputs` makes a batch from a model's input specs; `forward_failure` calls the model
compiled as `predict` does (a `tf.function` on TensorFlow, `jax.jit` on JAX) with every
layer's `call` watched, and names the innermost layer whose call raised (or the layer an
op error's name scope names); `train_failure` compiles and runs one gradient step (XLA on
TensorFlow); `finite_outputs` says whether every floating output is finite. The run check
(`keras_mp.conversion.runcheck`) pins what these find. Nothing here imports TensorFlow at module
level.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback

import keras
import numpy as np

import keras_mp.keep_list as keep_list
from keras_mp.conversion.boundary import index_inputs
from keras_mp.conversion.probe import _hooked

__all__ = [
    "RunFailure",
    "finite_outputs",
    "first_line",
    "forward_failure",
    "large_ids",
    "sample_inputs",
    "train_failure",
]

_SEQ = 8
_IMAGE = 64


@dataclasses.dataclass
class RunFailure:
    """Where a run failed: the innermost layer whose call raised (None: outside any
    layer), its address, and the error's first line."""

    layer: keras.layers.Layer | None
    address: str | None
    error: str


def first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:240]


def sample_inputs(model: keras.Model, batch_size: int = 2):
    """A batch built from a Functional model's input specs, or None.

    Unknown sizes become `batch_size` (first axis), 64 (the spatial axes of an image) or
    8; integer and boolean inputs (token ids, masks) are ones, float inputs uniform in
    [0, 1). A model without `inputs` (subclassed) gets None: pass a batch instead.
    """
    try:
        specs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not specs:
        return None
    rng = np.random.default_rng(0)

    def make(spec):
        shape = list(spec.shape)
        rank = len(shape)
        dims = [
            batch_size
            if i == 0 and d is None
            else (_IMAGE if rank == 4 and d is None else (d if d is not None else _SEQ))
            for i, d in enumerate(shape)
        ]
        dtype = keras.backend.standardize_dtype(spec.dtype)
        if dtype == "bool":
            return np.ones(dims, bool)
        if "int" in dtype:
            return np.ones(dims, dtype)
        return rng.uniform(size=dims).astype("float32")

    structure = getattr(model, "_inputs_struct", None)
    if isinstance(structure, dict):
        return {k: make(v) for k, v in structure.items()}
    made = [make(s) for s in specs]
    return made[0] if len(made) == 1 else made


def _named_in(error: BaseException, where: dict, layers: list):
    """The layer whose address the error text names (an op's name scope), deepest first."""
    text = str(error)
    by_address = {where[id(x)]: x for x in layers}
    for address in sorted(by_address, key=len, reverse=True):
        if "/" in address and address + "/" in text:
            return by_address[address]
    return None


def _traced_in(error: BaseException, layers: list):
    """The layer whose own code made the op an error's trace-time stack ends in, or None.

    XLA refuses a traced program as a whole after every layer's call returned (JAX on
    CPU: "The precision 'F16_F16_F32' is not supported by dot_general"); JAX attaches the
    Python stack where the op was traced (`JaxStackTraceBeforeTransformation`). Its
    innermost frame in a method a layer's class defines itself (not Keras' `Layer` or
    `Model` machinery) names the layer (the first such layer; `repair` pins its kind).
    """
    generic = (keras.layers.Layer, keras.Model, keras.Operation)
    by_file: dict = {}
    for layer in layers:
        if isinstance(layer, keras.Model):
            continue
        for cls in type(layer).__mro__:
            if cls in generic or cls is object:
                continue
            path = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if path:
                by_file.setdefault(os.path.realpath(path), []).append((cls, layer))
    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for exc in reversed(chain):  # the deepest cause holds the trace-time stack
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            for cls, layer in by_file.get(os.path.realpath(frame.filename), ()):
                if frame.name in cls.__dict__:
                    return layer
    return None


def _compiled_call(model, x):
    """`model(x)` as `predict` runs it: a `tf.function` on TensorFlow (some ops have no
    float16 kernel in a graph though they run eagerly), `jax.jit` on JAX."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        logger, level = tf.get_logger(), tf.get_logger().level
        logger.setLevel("ERROR")  # each check traces a new function: no retracing warning
        try:
            return tf.function(lambda batch: model(batch, training=False))(x)
        finally:
            logger.setLevel(level)
    if backend == "jax":
        import jax

        trainable = [v.value for v in model.trainable_variables]
        frozen = [v.value for v in model.non_trainable_variables]
        return jax.jit(lambda a, b, batch: model.stateless_call(a, b, batch)[0])(
            trainable, frozen, x
        )
    return model(x, training=False)


def forward_failure(model: keras.Model, x, finite: list | None = None) -> RunFailure | None:
    """Calls `model` on `x` once, compiled as `predict` runs it; None if it ran, else where
    it failed: the innermost layer whose call raised, or the layer an op error names.
    When it ran, whether every floating output is finite is appended to `finite`."""
    layers, _ = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    found: list = []

    def watch(layer, call):
        def watched(*args, **kwargs):
            try:
                return call(*args, **kwargs)
            except Exception as e:
                if not found:  # the innermost layer sees the error first
                    found.append((layer, e))
                raise

        return watched

    try:
        outputs = _hooked(model, watch, lambda: _compiled_call(model, x))
    except Exception as e:  # noqa: BLE001 - reported, then pinned or re-raised by the caller
        if found:
            layer, inner = found[0]
            return RunFailure(layer, where.get(id(layer)), first_line(inner))
        layer = _named_in(e, where, layers) or _traced_in(e, layers)
        return RunFailure(layer, where.get(id(layer)), first_line(e))
    if finite is not None:
        finite.append(_all_finite(outputs))
    return None


def _all_finite(outputs) -> bool:
    for t in keras.tree.flatten(outputs):
        a = np.asarray(keras.ops.convert_to_numpy(t))
        if a.dtype.kind in "fV" and not np.isfinite(a.astype("float32")).all():
            return False
    return True


def _objective(outputs):
    total = 0.0
    for t in keras.tree.flatten(outputs):
        dtype = keras.backend.standardize_dtype(getattr(t, "dtype", "int32"))
        if keras.backend.is_float_dtype(dtype):
            total = total + keras.ops.mean(keras.ops.cast(t, "float32"))
    return total


def train_failure(model: keras.Model, x) -> str | None:
    """Compiles and runs one gradient step of `model` on `x` (the mean of its floating
    outputs as the loss; XLA on TensorFlow, `jax.jit` on JAX). None if it ran, else the
    error's first line. No variable is changed (batch statistics and seeds updated by the
    training call are put back). Other backends: None (not checked)."""
    state = [(v, keras.ops.convert_to_numpy(v.value)) for v in model.non_trainable_variables]
    try:
        return _train_failure(model, x)
    finally:
        for v, value in state:
            v.assign(value)


def _train_failure(model: keras.Model, x) -> str | None:
    backend = keras.backend.backend()
    try:
        if backend == "tensorflow":
            import tensorflow as tf

            variables = model.trainable_variables

            @tf.function(jit_compile=True)
            def step(batch):
                with tf.GradientTape() as tape:
                    loss = _objective(model(batch, training=True))
                return tape.gradient(loss, variables)

            grads = step(x)
        elif backend == "jax":
            import jax

            trainable = [v.value for v in model.trainable_variables]
            frozen = [v.value for v in model.non_trainable_variables]

            def loss(values):
                out, _ = model.stateless_call(values, frozen, x, training=True)
                return _objective(out)

            grads = jax.jit(jax.grad(loss))(trainable)
        else:
            return None
        for g in grads:
            if g is not None:
                np.asarray(keras.ops.convert_to_numpy(g))  # block until it ran
    except Exception as e:  # noqa: BLE001 - reported, then pinned or re-raised by the caller
        return first_line(e)
    return None


def finite_outputs(model: keras.Model, x) -> bool:
    """Whether every floating output of `model` on `x` (compiled, as `predict`) is finite."""
    return _all_finite(_compiled_call(model, x))


def large_ids(model: keras.Model, x):
    """`x` (a batch made from `model.inputs`) with the float inputs that reach an
    `Embedding` (`boundary.index_inputs`) holding the largest ids, counting down from
    `input_dim - 1`: ids rounded in a low dtype then fetch a row past the table and fail
    (1999 is 2000 in bfloat16), where the uniform [0, 1) batch rounds to row 0 or 1.
    A batch the float32 model cannot run (the ids reach a smaller table too) is left as
    it was.
    """
    found = index_inputs(model) if x is not None else {}
    if not found or isinstance(x, dict):
        return x
    batch = list(x) if isinstance(x, list) else [x]
    for i, n in found.items():
        shape = batch[i].shape
        ids = np.maximum(n - 1 - np.arange(int(np.prod(shape))), 0)
        batch[i] = ids.reshape(shape).astype(batch[i].dtype)
    made = batch if isinstance(x, list) else batch[0]
    return made if forward_failure(model, made) is None else x
