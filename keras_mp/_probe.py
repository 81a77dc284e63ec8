"""Running a model layer by layer, and its gradients, on one batch (backend-neutral).

Shared by `keras_mp.audit` and `keras_mp.callbacks.NonFiniteGuard`. Gradients need the
backend's autodiff (TensorFlow's tape, `jax.grad`, torch autograd), imported lazily, as
Keras' own trainers do; everything else is `keras.ops`.
"""

from __future__ import annotations

import math

import keras
import numpy as np

__all__ = [
    "first_nonfinite_layer",
    "gradients",
    "layer_outputs",
    "max_abs",
    "output_layer_ids",
    "to_numpy",
    "unpack",
]


def unpack(data):
    """`(x, y, sample_weight)` from `x`, a tuple, or the first batch of a dataset."""
    if not isinstance(data, (tuple, list, dict, np.ndarray)) and not hasattr(data, "shape"):
        data = next(iter(data))  # a tf.data.Dataset, PyDataset or generator: first batch
    if isinstance(data, tuple):
        return keras.utils.unpack_x_y_sample_weight(data)
    return data, None, None


def to_numpy(t) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(t))


def max_abs(arrays) -> float:
    """The largest |value| over the float arrays (inf if any is non-finite)."""
    best = 0.0
    for a in arrays:
        a = np.asarray(a)
        if a.size == 0 or a.dtype.kind not in "fV":  # floats, and ml_dtypes' bfloat16/fp8
            continue
        a = a.astype("float32")
        if not np.all(np.isfinite(a)):
            return math.inf
        best = max(best, float(np.max(np.abs(a))))
    return best


def output_layer_ids(model: keras.Model, layers) -> set:
    """`id`s of the layers among `layers` whose output is a model output."""
    if isinstance(model, keras.Sequential):
        return {id(layers[-1])} if layers else set()
    outs = {id(t) for t in keras.tree.flatten(getattr(model, "outputs", None) or [])}
    ids = set()
    for layer in layers:
        try:
            tensors = keras.tree.flatten(layer.output)
        except (AttributeError, ValueError):
            continue
        if any(id(t) in outs for t in tensors):
            ids.add(id(layer))
    return ids


def layer_outputs(model: keras.Model, x) -> tuple[list, str | None]:
    """Runs `model` on `x` and returns `[(layer, [output arrays]), ...]` in execution order.

    Sequential models are run layer by layer; Functional models through a model over
    every layer's output. For subclassed models only the model's own output is returned.

    Returns:
        The list and a note (None, or why per-layer outputs were not available).
    """
    if isinstance(model, keras.Sequential):
        out, h = [], x
        for layer in model.layers:
            h = layer(h, training=False)
            out.append((layer, [to_numpy(t) for t in keras.tree.flatten(h)]))
        return out, None
    layers = [la for la in model.layers if not isinstance(la, keras.layers.InputLayer)]
    inputs = getattr(model, "inputs", None) if hasattr(model, "_operations") else None
    if inputs:
        try:
            probe = keras.Model(
                inputs[0] if len(inputs) == 1 else model.input, [la.output for la in layers]
            )
        except (ValueError, AttributeError) as e:
            note = f"per-layer outputs unavailable ({e}); only the model output is audited"
        else:
            results = probe(x, training=False)
            return [
                (la, [to_numpy(t) for t in keras.tree.flatten(r)])
                for la, r in zip(layers, results, strict=True)
            ], None
    else:
        note = "subclassed model: only the model output is audited (use a Functional model)"
    y = model(x, training=False)
    return [(model, [to_numpy(t) for t in keras.tree.flatten(y)])], note


def first_nonfinite_layer(model: keras.Model, data) -> tuple[str | None, str]:
    """Names the first layer whose output is non-finite on `data` (x or (x, y)).

    Returns:
        `(layer_name or None, sentence describing it)`.
    """
    x, _, _ = unpack(data)
    outputs, note = layer_outputs(model, x)
    peak = (None, 0.0)
    for layer, arrays in outputs:
        m = max_abs(arrays)
        if math.isinf(m):
            return layer.name, (
                f"On diagnose_data the first layer with a non-finite output is {layer.name!r} "
                f"({type(layer).__name__}, compute dtype {layer.compute_dtype})"
                + (" — its float16 output exceeded 65504" if layer.compute_dtype == "float16"
                   else "") + "."
            )
        if m >= peak[1]:
            peak = (layer.name, m)
    return None, (
        f"On diagnose_data every layer output is finite (largest |activation| {peak[1]:.3g} "
        f"at {peak[0]!r}); the non-finite values come from the loss or the backward pass, "
        "or from another batch." + (f" ({note})" if note else "")
    )


# -- gradients ---------------------------------------------------------------------------


def gradients(model, x, y, loss_fn, scale: float) -> list[np.ndarray]:
    """Gradients of `scale * loss` w.r.t. the trainable variables, divided by `scale`."""
    variables = model.trainable_variables
    backend = keras.backend.backend()

    def scaled_loss(y_pred):
        return keras.ops.cast(loss_fn(x, y, y_pred), "float32") * scale

    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape, keras.StatelessScope():
            loss = scaled_loss(model(x, training=True))
        grads = tape.gradient(loss, variables)
    elif backend == "jax":
        import jax

        def f(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values, strict=True))):
                return scaled_loss(model(x, training=True))

        grads = jax.grad(f)([v.value for v in variables])
    elif backend == "torch":
        import torch

        with keras.StatelessScope():
            loss = scaled_loss(model(x, training=True))
        grads = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
    else:
        raise NotImplementedError(f"audit: gradients are not supported on {backend!r}.")
    return [
        np.zeros(v.shape, "float32") if g is None else to_numpy(g).astype("float32") / scale
        for v, g in zip(variables, grads, strict=True)
    ]


