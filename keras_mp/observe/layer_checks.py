"""What the precision audit checks per layer: float32-required ops, gradients, tensor cores.

The facts `audit` (`keras_mp.observe.auditor`) reports for each layer: why a layer must
compute in float32 (`_fp32_reason`), whether it upcasts by itself, its matmul/conv
dimensions, and its gradient's underflow and overflow in float16 at a loss scale.
"""

from __future__ import annotations

import fnmatch

import keras
import numpy as np

import keras_mp.keep_list as keep_list
from keras_mp.keep_list import emits_logits

__all__ = ["FP16_MAX"]

FP16_MAX = 65504.0
_LOW = ("float16", "bfloat16")
_SOFTMAX = ("softmax", "log_softmax")
# Stock Keras layers whose call upcasts half-precision inputs to float32 internally.
_UPCASTS_INTERNALLY = (
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "RMSNormalization",
)
_NORMALIZATION = _UPCASTS_INTERNALLY + ("UnitNormalization",)
_ATTENTION = ("MultiHeadAttention", "GroupedQueryAttention", "Attention", "AdditiveAttention")


def _gradient_facts(g: np.ndarray, scale: float) -> dict:
    finite = np.isfinite(g)
    nonzero = finite & (g != 0)
    n = int(np.count_nonzero(nonzero))
    vals = g[nonzero]

    def underflow(s):
        with np.errstate(over="ignore"):  # overflow to inf is not underflow
            return float(np.count_nonzero((vals * s).astype(np.float16) == 0) / n) if n else 0.0

    over = float(np.count_nonzero(np.abs(vals * scale) > FP16_MAX) / n) if n else 0.0
    return {
        "grad_underflow_at_1": underflow(1.0),
        "grad_underflow_at_scale": underflow(scale),
        "grad_overflow_at_scale": over,
        "grad_nonfinite": float(1 - finite.mean()) if g.size else 0.0,
        "grad_max_abs": float(np.max(np.abs(vals))) if n else 0.0,
    }


# -- per-layer facts ----------------------------------------------------------------------


def _class_names(layer) -> set:
    return {c.__name__ for c in type(layer).__mro__}


def _fp32_reason(layer, is_output: bool, keep_fp32, lean: bool = False) -> str | None:
    names = _class_names(layer)
    act = getattr(layer, "activation", None)
    act_name = getattr(act, "__name__", act if isinstance(act, str) else None)
    if "Softmax" in names or act_name in _SOFTMAX:
        return "softmax"
    if names & set(_NORMALIZATION):
        return "normalization"
    if names & set(_ATTENTION):
        return "attention softmax"
    if (
        is_output
        and not keep_list.sublayers(layer)
        and not (emits_logits(layer) and (layer.variable_dtype == "float32" or lean))
    ):
        # A logits projection with FP32 master weights (or lean_bfloat16's compensated
        # bfloat16 weights) may run low: the loss up-casts.
        return "model output"
    for entry in keep_fp32 or ():
        if isinstance(entry, type) and isinstance(layer, entry):
            return f"keep_fp32 {entry.__name__}"
        if isinstance(entry, str) and (
            entry in names
            or fnmatch.fnmatch(layer.name, entry)
            or fnmatch.fnmatch(getattr(layer, "path", ""), entry)
        ):
            return f"keep_fp32 {entry!r}"
    return None


def _handles_own_precision(layer) -> bool:
    """keras_mp layers, stock layers that upcast internally, and attention whose softmax
    sublayer runs in float32 (pinned by `convert`, or made so by keras_hub) do their
    sensitive math in FP32."""
    if type(layer).__module__.startswith("keras_mp") or (
        _class_names(layer) & set(_UPCASTS_INTERNALLY)
    ):
        return True
    softmax = getattr(layer, "_softmax", None) or getattr(layer, "softmax", None)
    return isinstance(softmax, keras.layers.Layer) and (
        softmax.compute_dtype == "float32" or type(softmax).__module__.startswith("keras_mp")
    )


def _matmul_dims(layer) -> tuple:
    names = _class_names(layer)
    if names & {"MultiHeadAttention", "GroupedQueryAttention"}:
        dims = [getattr(layer, "key_dim", None), getattr(layer, "value_dim", None)]
        query = getattr(layer, "query_dense", None)
        if query is not None and getattr(query, "kernel", None) is not None:
            dims.insert(0, query.kernel.shape[0])
        return tuple(int(d) for d in dims if d)
    if not names & {"Dense", "EinsumDense", "BaseConv"}:
        return ()
    kernel = getattr(layer, "kernel", None)
    if kernel is None:
        return ()
    shape = tuple(int(d) for d in kernel.shape)
    if "BaseConv" in names:
        return shape[-2:]  # input channels (per group) and filters
    return shape
