"""Running a model on one batch while watching every layer, and its gradients (any backend).

`trace(model, x)` calls the model once, eagerly, with every layer's `call` (nested models
and sublayers of blocks included) wrapped to record the largest |value| of its main input
and output (masks and biases passed beside them are left out), their dtypes and shapes:
the audit, calibration and `NonFiniteGuard` read it. Keras has no forward hooks; the
wrappers are instance attributes removed when the call returns. Gradients need the
backend's autodiff (TensorFlow's tape, `jax.grad`, torch autograd), imported lazily, as
Keras' own trainers do; everything else is `keras.ops`.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np

import keras_mp.keep_list as keep_list
from keras_mp.conversion.boundary import casts_to

__all__ = [
    "LayerTrace",
    "activation_gradients",
    "first_nonfinite_layer",
    "gradients",
    "matmul_flops",
    "max_abs",
    "to_numpy",
    "trace",
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
    from keras_mp.numerics.recast import host_value  # without NumPy 2's warning on TensorFlow

    return host_value(t)


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


def _floats(structure) -> list:
    out = []
    for t in keras.tree.flatten(structure):
        dtype = getattr(t, "dtype", None)
        if dtype is not None and keras.backend.is_float_dtype(
            keras.backend.standardize_dtype(dtype)
        ):
            out.append(t)
    return out


def _peak(tensors) -> float | None:
    try:
        return max_abs(to_numpy(t) for t in tensors)
    except Exception:  # noqa: BLE001 - a tracer inside a layer's own jit/remat: not recorded
        return None


@dataclasses.dataclass
class LayerTrace:
    """What one layer saw during `trace` (all its calls together).

    Attributes:
        layer: the layer.
        address: its path (or parent path and name, see `keep_list.addresses`).
        depth: how many layers contain it (0: a layer of the model itself).
        calls: how many times it was called.
        input_max: largest |value| of its main input, the first argument (inf if
            non-finite).
        output_max: the same for its main output (the first of a tuple, all of a dict).
        output_dtype: dtype of its first floating output.
        input_shapes / output_shapes: shapes of the first call's floating tensors.
        end: completion order of its first call (inner layers finish before their block).
    """

    layer: keras.layers.Layer
    address: str
    depth: int
    calls: int = 0
    input_max: float = 0.0
    output_max: float = 0.0
    output_dtype: str | None = None
    input_shapes: list = dataclasses.field(default_factory=list)
    output_shapes: list = dataclasses.field(default_factory=list)
    end: int = -1


def trace(model: keras.Model, x, training: bool = False) -> list:
    """Calls `model` on `x` once and records what every layer saw.

    Args:
        model: A built Keras model (any kind: Functional, Sequential, subclassed, nested).
        x: The model inputs (one batch).
        training: The `training` flag of the call.

    Returns:
        `LayerTrace`s of the layers that were called, in completion order of their first
        call (a block after its sublayers).
    """
    _, parents = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    records: dict[int, LayerTrace] = {}
    finished = [0]

    def depth(layer) -> int:
        d, parent = 0, parents.get(id(layer))
        while parent is not None and parent is not model:
            d, parent = d + 1, parents.get(id(parent))
        return d

    def wrap(layer, call):
        def recorded(*args, **kwargs):
            outputs = call(*args, **kwargs)
            # The main tensors: the first argument, and the first output of a tuple (masks,
            # position biases and caches travel beside them with their own sentinel values).
            ins = _floats(args[0] if args else next(iter(kwargs.values()), None))
            outs = _floats(
                outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
            )
            peaks = _peak(ins), _peak(outs)
            if None in peaks:
                return outputs  # symbolic (Keras building the layer, a jit inside): no values
            rec = records.get(id(layer))
            if rec is None:
                rec = records[id(layer)] = LayerTrace(layer, where[id(layer)], depth(layer))
            rec.input_max = max(rec.input_max, peaks[0])
            rec.output_max = max(rec.output_max, peaks[1])
            if rec.calls == 0:
                rec.input_shapes = [tuple(t.shape) for t in ins]
                rec.output_shapes = [tuple(t.shape) for t in outs]
                rec.output_dtype = keras.backend.standardize_dtype(outs[0].dtype) if outs else None
                rec.end = finished[0]
                finished[0] += 1
            rec.calls += 1
            return outputs

        return recorded

    _hooked(model, wrap, lambda: model(x, training=training))
    return sorted(records.values(), key=lambda r: r.end)


def _main_output(outputs):
    """The tensor `activation_gradients` perturbs: the output, or a tuple's first element."""
    main = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
    dtype = getattr(main, "dtype", None)
    if dtype is None or not keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype)):
        return None
    return main


def _with_main_output(outputs, main):
    if isinstance(outputs, (tuple, list)) and outputs:
        return type(outputs)([main, *outputs[1:]])
    return main


def _hooked(model, make_hook, run):
    """Runs `run()` with every layer's `call` wrapped by `make_hook(layer, call)`."""
    layers, _ = keep_list.layer_tree(model)
    wrapped = []  # (layer, its own `call` attribute before: a boundary cast, or None)
    try:
        for layer in layers:
            own = vars(layer).get("call")
            if isinstance(layer, keras.layers.InputLayer) or (
                own is not None and casts_to(layer) is None
            ):
                continue
            object.__setattr__(layer, "call", make_hook(layer, layer.call))
            wrapped.append((layer, own))
        return run()
    finally:
        for layer, own in wrapped:
            if own is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", own)


def activation_gradients(model: keras.Model, x, y, loss_fn) -> dict:
    """The largest |d loss / d output| of every layer's main output, at loss scale 1.

    Each layer call's main output gets a zero tensor added; the loss is differentiated with
    respect to those zeros (the backend's autodiff: TensorFlow's tape, `jax.grad`).

    Args:
        model: A built model.
        x, y: One batch.
        loss_fn: `(x, y, y_pred) -> scalar loss`.

    Returns:
        `{address: largest |gradient|}`; empty on a backend without support here (torch).
    """
    where = keep_list.addresses(model)
    calls: list = []  # (address, shape, dtype) of each call's main output, in call order

    def record(layer, call):
        def hooked(*args, **kwargs):
            outputs = call(*args, **kwargs)
            main = _main_output(outputs)
            if main is not None and _peak([main]) is not None:
                calls.append((where[id(layer)], tuple(main.shape), main.dtype))
            return outputs

        return hooked

    _hooked(model, record, lambda: model(x, training=False))

    def loss_with(eps):
        def run():
            return keras.ops.cast(loss_fn(x, y, model(x, training=False)), "float32")

        return _hooked(model, _adder(eps, [0]), run)

    zeros = [np.zeros(shape, "float32") for _, shape, _ in calls]
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        eps = [tf.constant(z) for z in zeros]
        with tf.GradientTape() as tape:
            tape.watch(eps)
            loss = loss_with(eps)
        grads = tape.gradient(loss, eps)
    elif backend == "jax":
        import jax

        grads = jax.grad(loss_with)([jax.numpy.asarray(z) for z in zeros])
    else:
        return {}
    result: dict = {}
    for (address, _, _), g in zip(calls, grads, strict=False):
        if g is not None:
            result[address] = max(result.get(address, 0.0), max_abs([to_numpy(g)]))
    return result


def _adder(eps, index):
    def make(layer, call):
        def hooked(*args, **kwargs):
            outputs = call(*args, **kwargs)
            main = _main_output(outputs)
            if main is None or index[0] >= len(eps):
                return outputs
            bump = keras.ops.cast(eps[index[0]], main.dtype)
            index[0] += 1
            return _with_main_output(outputs, main + bump)

        return hooked

    return make


def matmul_flops(record: LayerTrace) -> float:
    """Floating-point operations of a traced layer's own matmul or convolution (one call).

    Dense, EinsumDense and convolution layers: 2 x output elements x the kernel elements
    each output element uses. Attention layers with `num_heads` and `key_dim` add their
    score and value matmuls. Other layers: 0 (their sublayers are counted themselves).
    """
    layer = record.layer
    kernel = getattr(layer, "kernel", None) if not keep_list.sublayers(layer) else None
    if kernel is not None and record.output_shapes and hasattr(kernel, "shape"):
        out = record.output_shapes[0]
        if None in out:
            return 0.0
        shape = tuple(int(d) for d in kernel.shape)
        size = int(np.prod(shape))
        if isinstance(layer, keras.layers.EinsumDense):
            spec, out_spec = layer.equation.split("->")
            kernel_spec = spec.split(",")[1]
            produced = int(
                np.prod(
                    [d for c, d in zip(kernel_spec, shape, strict=False) if c in out_spec] or [1]
                )
            )
        elif isinstance(layer, keras.layers.DepthwiseConv2D):
            produced = shape[-2] * shape[-1]
        else:
            produced = shape[-1]
        return 2.0 * float(np.prod(out)) * size / max(produced, 1)
    heads, key_dim = getattr(layer, "num_heads", None), getattr(layer, "key_dim", None)
    if heads and key_dim and len(record.input_shapes) >= 1:
        q = record.input_shapes[0]
        kv = record.input_shapes[1] if len(record.input_shapes) > 1 else q
        if None in q or None in kv or len(q) < 3:
            return 0.0
        value_dim = getattr(layer, "value_dim", None) or key_dim
        return 2.0 * q[0] * heads * q[1] * kv[1] * (key_dim + value_dim)
    return 0.0


def first_nonfinite_layer(model: keras.Model, data) -> tuple[str | None, str]:
    """Names the innermost, first layer whose output is non-finite on `data` (x or (x, y)).

    Returns:
        `(layer address or None, sentence describing it)`.
    """
    x, _, _ = unpack(data)
    records = trace(model, x)
    peak = (None, 0.0)
    for rec in records:
        layer = rec.layer
        if rec.output_max is not None and math.isinf(rec.output_max):
            return rec.address, (
                f"On diagnose_data the first layer with a non-finite output is {rec.address!r} "
                f"({type(layer).__name__}, compute dtype {layer.compute_dtype})"
                + (
                    " — its float16 output exceeded 65504"
                    if layer.compute_dtype == "float16"
                    and rec.input_max is not None
                    and math.isfinite(rec.input_max)
                    else ""
                )
                + "."
            )
        if rec.output_max is not None and rec.output_max >= peak[1]:
            peak = (rec.address, rec.output_max)
    return None, (
        f"On diagnose_data every layer output is finite (largest |activation| {peak[1]:.3g} "
        f"at {peak[0]!r}); the non-finite values come from the loss or the backward pass, "
        "or from another batch."
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
