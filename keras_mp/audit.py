"""The precision audit: what would go wrong if (or why it goes wrong when) a model runs low.

`audit(model, data)` runs the model layer by layer on one batch and reports, per layer,
its compute and variable dtypes, whether it is a numerically sensitive op running below
float32, its largest activation against the float16 maximum (65504), the fraction of its
gradient elements that underflow in float16 at scale 1 and at the loss scale, and whether
its matmul/conv dimensions suit tensor cores (multiples of 8). It works on float32 models
(the point: audit before converting) and on mixed models, built with or without keras_mp.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

from keras_mp import keep_list
from keras_mp._probe import gradients, to_numpy, trace, unpack
from keras_mp.keep_list import emits_logits

__all__ = ["AuditReport", "LayerAudit", "VariableAudit", "audit"]

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


@dataclasses.dataclass
class VariableAudit:
    """Gradient facts for one trainable variable (fractions of its non-zero gradient elements).

    Attributes:
        path: the variable's path.
        shape: its shape.
        dtype: its dtype.
        grad_underflow_at_1: fraction that round to 0 in float16 at scale 1.
        grad_underflow_at_scale: the same after multiplying by the audit's loss scale.
        grad_overflow_at_scale: fraction that exceed 65504 after scaling.
        grad_nonfinite: fraction of all elements that are inf/NaN.
        grad_max_abs: the largest finite gradient magnitude.
    """

    path: str
    shape: tuple
    dtype: str
    grad_underflow_at_1: float | None = None
    grad_underflow_at_scale: float | None = None
    grad_overflow_at_scale: float | None = None
    grad_nonfinite: float | None = None
    grad_max_abs: float | None = None


@dataclasses.dataclass
class LayerAudit:
    """What the audit found for one layer.

    Attributes:
        name / class_name / compute_dtype / variable_dtype: the layer's identity and dtypes.
        fp32_reason: why the layer should compute in float32 (None: it need not).
        runs_low: it should compute in float32 but computes in float16/bfloat16.
        path / depth: where the layer sits (its path; 0 for a layer of the model itself,
            1 for a sublayer of one, ...).
        max_abs_activation: the largest |output| on the batch (inf if non-finite; None if
            it could not be read).
        max_abs_input: the same for its floating inputs (e.g. a residual stream).
        overflow_risk: the output exceeds 65504 and the layer runs (or, in a float32
            model, would run) in float16.
        matmul_dims: the matmul/conv dimensions that tensor cores tile.
        misaligned_dims: those of `matmul_dims` that are not multiples of 8.
        variables: a `VariableAudit` per trainable variable.
    """

    name: str
    class_name: str
    compute_dtype: str
    variable_dtype: str
    path: str = ""
    depth: int = 0
    fp32_reason: str | None = None
    runs_low: bool = False
    max_abs_activation: float | None = None
    overflow_risk: bool = False
    max_abs_input: float | None = None
    matmul_dims: tuple = ()
    misaligned_dims: tuple = ()
    variables: list = dataclasses.field(default_factory=list)

    def worst(self, field: str) -> float | None:
        values = [getattr(v, field) for v in self.variables if getattr(v, field) is not None]
        return max(values) if values else None


@dataclasses.dataclass
class AuditReport:
    """The result of `audit()`: one `LayerAudit` per layer, a verdict and advice.

    `str(report)` is a table; `to_dict()` a JSON-ready dict; `report["name"]` a layer.

    Attributes:
        model_name: the model's name.
        loss_scale: the scale the "at scale" gradient columns use.
        loss_scale_source: where it came from.
        layers: the `LayerAudit`s, in execution order.
        notes: what the audit could not do, and why.
        converted: the model was made by `kmp.convert` (its layers share a policy map).
        verdict: one line.
        advice: concrete actions.
    """

    model_name: str
    loss_scale: float
    loss_scale_source: str
    layers: list
    notes: list
    converted: bool = False
    verdict: str = ""
    advice: list = dataclasses.field(default_factory=list)

    def __getitem__(self, name: str) -> LayerAudit:
        """The row of the layer with this path, or else the first with this name."""
        for layer in self.layers:
            if layer.path == name:
                return layer
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"No layer named {name!r} in the audit of {self.model_name!r}.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        def num(x, fmt="{:.3g}"):
            return "-" if x is None else fmt.format(x)

        def pct(x):
            return "-" if x is None else f"{100 * x:.1f}%"

        header = (
            "layer", "class", "compute/var", "fp32?", "max|act|", "grad uflow@1",
            f"@{self.loss_scale:g}", "dims%8",
        )
        rows = []
        for la in self.layers:
            rows.append((
                la.path or la.name,
                la.class_name,
                f"{la.compute_dtype}/{la.variable_dtype}",
                ("LOW! " if la.runs_low else "") + (la.fp32_reason or "") or "-",
                num(la.max_abs_activation) + (" >FP16!" if la.overflow_risk else ""),
                pct(la.worst("grad_underflow_at_1")),
                pct(la.worst("grad_underflow_at_scale")),
                "-" if not la.matmul_dims else (
                    "ok" if not la.misaligned_dims else
                    "pad " + ",".join(map(str, la.misaligned_dims))
                ),
            ))
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        out = [f"Precision audit of {self.model_name!r} (loss scale {self.loss_scale:g}, "
               f"{self.loss_scale_source})", line(header), line(["-" * w for w in widths])]
        out += [line(r) for r in rows]
        out += [f"note: {n}" for n in self.notes]
        out += ["", f"Verdict: {self.verdict}"]
        out += [f"  - {a}" for a in self.advice]
        return "\n".join(out)


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


def _fp32_reason(layer, is_output: bool, keep_fp32) -> str | None:
    names = _class_names(layer)
    act = getattr(layer, "activation", None)
    act_name = getattr(act, "__name__", act if isinstance(act, str) else None)
    if "Softmax" in names or act_name in _SOFTMAX:
        return "softmax"
    if names & set(_NORMALIZATION):
        return "normalization"
    if names & set(_ATTENTION):
        return "attention softmax"
    if is_output and not keep_list.sublayers(layer) and not (
        emits_logits(layer) and layer.variable_dtype == "float32"
    ):
        # A logits projection with FP32 master weights may run low: the loss up-casts.
        return "model output"
    for entry in keep_fp32 or ():
        if isinstance(entry, type) and isinstance(layer, entry):
            return f"keep_fp32 {entry.__name__}"
        if isinstance(entry, str) and (
            entry in names or fnmatch.fnmatch(layer.name, entry)
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


def _loss_scale(model, loss_scale) -> tuple[float, str]:
    if loss_scale is not None:
        if not isinstance(loss_scale, (int, float)) or not 0 < loss_scale < math.inf:
            raise ValueError(
                f"audit: `loss_scale` must be a finite number > 0, got {loss_scale!r}."
            )
        return float(loss_scale), "given"
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer) and opt.built:
        return float(to_numpy(opt.dynamic_scale.value)), "the compiled optimizer's"
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return float(opt.initial_scale), "the compiled optimizer's initial"
    return 2.0**16, "default 2**16; no LossScaleOptimizer compiled"


def _stock_scaler_message(model) -> str | None:
    from keras_mp.autoscale import stock_scaler_message

    return stock_scaler_message(model)


def _resolve_loss(model, loss):
    if loss is not None:
        fn = keras.losses.get(loss)
        name = getattr(fn, "name", getattr(fn, "__name__", loss))
        # Loss functions (as opposed to Loss objects) return per-sample values.
        return (lambda x, y, y_pred: keras.ops.mean(fn(y, y_pred))), f"loss {name!r}"
    if getattr(model, "compiled", False) and getattr(model, "loss", None) is not None:
        return (lambda x, y, y_pred: model.compute_loss(x, y, y_pred, training=True)), (
            "the compiled loss"
        )
    return None, None


# -- audit ------------------------------------------------------------------------------


def audit(
    model: keras.Model,
    data: Any,
    *,
    loss: Any = None,
    loss_scale: float | None = None,
    keep_fp32: Iterable | None = None,
    underflow_threshold: float = 0.01,
) -> AuditReport:
    """Audits a model's readiness for (or behaviour under) mixed precision on one batch.

    The model runs as it is (a float32 model in float32: the audit tells what float16
    would do to it). Gradients are those of `loss_scale * loss`, computed the way the
    model runs and divided back in float32; an element "underflows" when it is non-zero
    but rounds to 0 in float16 after multiplying by the scale (1, then the loss scale).

    Args:
        model: a built Keras model (Functional or Sequential for per-layer results).
        data: one batch, `x` or `(x, y)` (or `(x, y, sample_weight)`); a dataset or
            iterator gives its first batch. Without `y`, or without a loss, the gradient
            columns are skipped (the report says so).
        loss: loss for the gradients; default: the compiled loss.
        loss_scale: scale for the "at scale" column; default: the scale of a compiled
            `LossScaleOptimizer`, else 2**16.
        keep_fp32: extra layers that must stay float32: layer classes, class names or
            `fnmatch` patterns over layer names/paths (softmax, normalization, attention
            and output layers are always checked).
        underflow_threshold: fraction of a variable's gradient elements underflowing at
            the loss scale above which the report advises a larger scale.

    Returns:
        An `AuditReport`.

    Example:

    >>> report = kmp.audit(model, (x[:64], y[:64]))  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    >>> report["dense"].overflow_risk  # doctest: +SKIP
    """
    if not isinstance(model, keras.Model):
        raise ValueError(f"audit: `model` must be a keras.Model, got {type(model).__name__}.")
    if not 0 <= underflow_threshold <= 1:
        raise ValueError(
            f"audit: `underflow_threshold` must lie in [0, 1], got {underflow_threshold!r}."
        )
    for entry in keep_fp32 or ():
        if not (isinstance(entry, str) or isinstance(entry, type)):
            raise ValueError(
                f"audit: invalid `keep_fp32` entry {entry!r}: expected a layer class, a class "
                "name or an fnmatch pattern over layer names."
            )
    x, y, _ = unpack(data)
    scale, scale_source = _loss_scale(model, loss_scale)
    notes: list[str] = []
    records = [r for r in trace(model, x) if not isinstance(r.layer, keras.layers.InputLayer)]
    output_ids = {id(layer) for layer in keep_list.output_layers(model)}
    model_fp32 = all(r.layer.compute_dtype == "float32" for r in records)
    message = _stock_scaler_message(model)
    if message:
        notes.append(message)

    grads = {}
    loss_fn, loss_desc = _resolve_loss(model, loss)
    if y is None:
        notes.append("no targets in `data`: gradient columns skipped (pass (x, y))")
    elif loss_fn is None:
        notes.append("model not compiled and no `loss=`: gradient columns skipped")
    else:
        values = gradients(model, x, y, loss_fn, scale)
        grads = {id(v): g for v, g in zip(model.trainable_variables, values, strict=True)}
        samples = len(np.asarray(keras.tree.flatten(y)[0]))
        notes.append(f"gradients of {loss_desc} on {samples} samples")

    rows = []
    for rec in records:
        layer = rec.layer
        reason = _fp32_reason(layer, id(layer) in output_ids, keep_fp32)
        low = layer.compute_dtype in _LOW
        m = rec.output_max
        dims = _matmul_dims(layer)
        own = list(layer._trainable_variables)
        rows.append(LayerAudit(
            name=layer.name,
            class_name=type(layer).__name__,
            compute_dtype=layer.compute_dtype,
            variable_dtype=layer.variable_dtype,
            path=rec.address,
            depth=rec.depth,
            fp32_reason=reason,
            runs_low=bool(reason) and low and not _handles_own_precision(layer),
            max_abs_activation=m,
            max_abs_input=rec.input_max,
            overflow_risk=m is not None and m > FP16_MAX and (
                layer.compute_dtype == "float16" or (model_fp32 and not low)
            ),
            matmul_dims=dims,
            misaligned_dims=tuple(d for d in dims if d % 8),
            variables=[
                VariableAudit(
                    path=v.path, shape=tuple(v.shape), dtype=v.dtype,
                    **(_gradient_facts(grads[id(v)], scale) if id(v) in grads else {}),
                )
                for v in own
            ],
        ))
    converted = hasattr(model, "precision_plan") or isinstance(
        model.dtype_policy, keras.dtype_policies.DTypePolicyMap
    )
    report = AuditReport(model.name, scale, scale_source, rows, notes, converted)
    _conclude(report, model_fp32, underflow_threshold)
    return report


def _suggest_scale(layers) -> float | None:
    """The largest power of two keeping every gradient at least 2x below 65504."""
    peak = max((v.grad_max_abs or 0.0 for la in layers for v in la.variables), default=0.0)
    if not peak:
        return None
    return 2.0 ** min(24, math.floor(math.log2(FP16_MAX / 2 / peak)))


def _conclude(report: AuditReport, model_fp32: bool, threshold: float) -> None:
    advice = report.advice
    over = [la for la in report.layers if la.overflow_risk]
    low = [la for la in report.layers if la.runs_low]
    scale = report.loss_scale
    under = [(la, v) for la in report.layers for v in la.variables
             if (v.grad_underflow_at_scale or 0) > threshold]
    too_big = [(la, v) for la in report.layers for v in la.variables
               if (v.grad_overflow_at_scale or 0) > 0]
    pad = [la for la in report.layers if la.misaligned_dims]
    if over:
        first = over[0]
        advice.append(
            f"Layer {first.name!r} reaches |x| = {first.max_abs_activation:.3g} > 65504: in "
            "float16 its output becomes inf. Use 'mixed_bfloat16' (float32's range), or pin "
            f"{', '.join(repr(la.name) for la in over)} to float32 with keras_mp "
            "(kmp.layers.Float32(layer), or kmp.Policy(..., keep_fp32=[...])), or rescale "
            "the inputs/weights feeding it."
        )
    for la in low:
        if la.depth > 0 or report.converted:
            fix = (
                f"add {la.path!r} to the keep-list and convert the float32 model again, "
                f"kmp.convert(model, kmp.Policy(policy, keep_fp32=kmp.DEFAULT_KEEP_FP32 + "
                f"({la.path!r},)))"
            )
        else:
            fix = {
                "Softmax": "use kmp.layers.Softmax (softmax in float32)",
                "MultiHeadAttention": "use kmp.layers.MultiHeadAttention (softmax in float32)",
            }.get(la.class_name, "wrap it in kmp.layers.Float32")
            fix += "; kmp.convert(model, policy) pins the default keep-list for you"
        advice.append(
            f"Layer {la.path or la.name!r} ({la.class_name}, {la.fp32_reason}) computes in "
            f"{la.compute_dtype}: {fix}."
        )
    suggested = _suggest_scale(report.layers)
    if under:
        la, v = max(under, key=lambda p: p[1].grad_underflow_at_scale)
        better = f" (about 2**{int(math.log2(suggested))})" if suggested and suggested > scale \
            else ""
        advice.append(
            f"{v.grad_underflow_at_scale:.1%} of the gradient elements of {v.path!r} underflow in "
            f"float16 at loss scale {scale:g}: raise the loss scale{better}, or use bfloat16."
        )
    if too_big:
        la, v = max(too_big, key=lambda p: p[1].grad_overflow_at_scale)
        lower = f" to about 2**{int(math.log2(suggested))}" if suggested else ""
        advice.append(
            f"{v.grad_overflow_at_scale:.1%} of the gradient elements of {v.path!r} exceed "
            f"65504 at loss scale {scale:g} (every such step is skipped): lower the initial "
            f"scale{lower}."
        )
    for la in pad:
        padded = ", ".join(f"{d} -> {-(-d // 8) * 8}" for d in la.misaligned_dims)
        advice.append(
            f"Pad {la.name!r} ({la.class_name}) dimensions {padded}: tensor cores need "
            "multiples of 8."
        )
    if over:
        report.verdict = (
            "NOT safe in float16: activations overflow 65504"
            + ("; bfloat16 is safe for range." if model_fp32 or not low else ".")
        )
    elif low or under or too_big:
        report.verdict = "Runs, but with avoidable precision loss: see the advice."
    else:
        report.verdict = "OK for mixed precision" + (
            " (as a float32 model: convert it with kmp.convert)." if model_fp32 else "."
        )
    if not advice:
        advice.append("Nothing to change.")
