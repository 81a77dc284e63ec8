"""The precision audit: what would go wrong if (or why it goes wrong when) a model runs low.

`audit(model, data)` runs the model layer by layer on one batch and reports, per layer,
its compute and variable dtypes, whether it is a numerically sensitive op running below
float32, its largest activation against the float16 maximum (65504), the fraction of its
gradient elements that underflow in float16 at scale 1 and at the loss scale, and whether
its matmul/conv dimensions suit tensor cores (multiples of 8). It works on float32 models
(the point: audit before converting) and on mixed models, built with or without keras_mp.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import keras
import numpy as np

import keras_mp.keep_list as keep_list
from keras_mp.conversion.probe import gradients, to_numpy, trace, unpack
from keras_mp.observe.audit_report import AuditReport, LayerAudit, VariableAudit
from keras_mp.observe.layer_checks import (
    _LOW,
    FP16_MAX,
    _fp32_reason,
    _gradient_facts,
    _handles_own_precision,
    _matmul_dims,
)

__all__ = ["AuditReport", "LayerAudit", "VariableAudit", "audit"]


def _loss_scale(model, loss_scale) -> tuple[float, str]:
    if loss_scale is not None:
        if not isinstance(loss_scale, (int, float)) or not 0 < loss_scale < math.inf:
            raise ValueError(
                f"audit: `loss_scale` must be a finite number > 0, got {loss_scale!r}."
            )
        return float(loss_scale), "given"
    opt = getattr(model, "optimizer", None)
    if getattr(opt, "skip_only", False):
        opt = None  # bfloat16's or float32's fixed 1: it skips, it does not scale
    if isinstance(opt, keras.optimizers.LossScaleOptimizer) and opt.built:
        return float(to_numpy(opt.dynamic_scale.value)), "the compiled optimizer's"
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return float(opt.initial_scale), "the compiled optimizer's initial"
    from keras_mp.scaling.loss_scale import LossScaleConfig

    default = LossScaleConfig().initial_scale
    return default, f"default 2**{math.log2(default):.0f}; no LossScaleOptimizer compiled"


def _stock_scaler_message(model) -> str | None:
    from keras_mp.scaling.autoscale import stock_scaler_message

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
    margin: float = 4.0,
    propose: bool = True,
    tensor_cores: bool | None = None,
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
            `LossScaleOptimizer`, else `kmp.LossScaleOptimizer`'s default initial
            scale (2**15).
        keep_fp32: extra layers that must stay float32: layer classes, class names or
            `fnmatch` patterns over layer names/paths (softmax, normalization, attention
            and output layers are always checked).
        margin: calibration's safety factor for the proposal (see `kmp.plan`).
        propose: also make the calibrated float16 plan on `data` (`report.proposal`): the
            float32 model (or a float32 copy of a converted one) is measured and the
            converted model checked, exactly as `kmp.convert(..., calibrate=data)` does.
        underflow_threshold: fraction of a variable's gradient elements underflowing at
            the loss scale above which the report advises a larger scale.
        tensor_cores: whether to advise padding matmul/conv dimensions to multiples of 8
            (what NVIDIA tensor cores tile); default: only where this machine has such a
            GPU (`kmp.hardware.report()`). Pass True to audit for a GPU from a CPU.

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
    failure = _run_failure(model, x)
    if failure:
        notes.append(failure)
    records = [r for r in trace(model, x) if not isinstance(r.layer, keras.layers.InputLayer)]
    output_ids = {id(layer) for layer in keep_list.output_layers(model)}
    model_fp32 = all(r.layer.compute_dtype == "float32" for r in records)
    # A bfloat16 model trained without a scaler (as compile leaves one) has float32's range:
    # float16's gradient underflow and overflow do not apply to it.
    opt = getattr(model, "optimizer", None)
    unscaled_bf16 = (
        loss_scale is None
        and (
            not isinstance(opt, keras.optimizers.LossScaleOptimizer)
            or getattr(opt, "skip_only", False)  # bfloat16's fixed 1 only skips
        )
        and any(r.layer.compute_dtype == "bfloat16" for r in records)
        and not any(r.layer.compute_dtype == "float16" for r in records)
    )
    if unscaled_bf16:
        scale_source = (
            "the model computes in bfloat16, which needs no loss scaling; "
            "the gradient columns are float16's, for comparison"
        )
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

    from keras_mp.lean import LeanOptimizer
    from keras_mp.scaling.autoscale import wants_lean_optimizer

    lean = isinstance(getattr(model, "optimizer", None), LeanOptimizer) or (
        wants_lean_optimizer(model)
    )
    rows = []
    for rec in records:
        layer = rec.layer
        reason = _fp32_reason(layer, id(layer) in output_ids, keep_fp32, lean)
        low = layer.compute_dtype in _LOW
        m = rec.output_max
        dims = _matmul_dims(layer)
        own = list(layer._trainable_variables)
        rows.append(
            LayerAudit(
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
                overflow_risk=m is not None
                and m > FP16_MAX
                and (layer.compute_dtype == "float16" or (model_fp32 and not low)),
                matmul_dims=dims,
                misaligned_dims=tuple(d for d in dims if d % 8),
                variables=[
                    VariableAudit(
                        path=v.path,
                        shape=tuple(v.shape),
                        dtype=v.dtype,
                        **(_gradient_facts(grads[id(v)], scale) if id(v) in grads else {}),
                    )
                    for v in own
                ],
            )
        )
    converted = hasattr(model, "precision_plan") or isinstance(
        model.dtype_policy, keras.dtype_policies.DTypePolicyMap
    )
    report = AuditReport(model.name, scale, scale_source, rows, notes, converted)
    report.state_bytes = _state(model)
    if propose:
        report.proposal = _proposal(model, x, margin, model_fp32)
    if tensor_cores is None:
        tensor_cores = _has_tensor_cores()
    if not tensor_cores and any(la.misaligned_dims for la in report.layers):
        report.notes.append(
            "dims%8: tensor-core alignment, which matters on an NVIDIA GPU (none here: "
            "no padding advised; audit(..., tensor_cores=True) to advise it for one)"
        )
    _conclude(report, model_fp32, underflow_threshold, not unscaled_bf16, tensor_cores=tensor_cores)
    return report


def _has_tensor_cores() -> bool:
    """Whether this machine has a GPU with tensor cores (float16 fast: NVIDIA 7.0+)."""
    from keras_mp.hardware import report as hardware_report

    try:
        devices = hardware_report().devices
    except Exception:  # a backend that cannot list its devices: assume none
        return False
    return any(d.kind == "GPU" and d.fp16 for d in devices)


def _run_failure(model, x) -> str | None:
    """convert's run check on a low-precision model: the layer that cannot run compiled
    in its compute dtype (`keras_mp.conversion.trial.forward_failure`), as a note, or None."""
    from keras_mp.conversion.trial import forward_failure

    if all(x_.compute_dtype not in _LOW for x_ in model._flatten_layers(include_self=True)):
        return None
    found = forward_failure(model, x)
    if found is None:
        return None
    where = f"layer {found.address!r}" if found.address else f"model {model.name!r}"
    return (
        f"run check: {where} cannot run compiled in its compute dtype ({found.error[:120]})"
        "; kmp.convert(the float32 model, policy) pins it to float32 (check='auto')"
    )


def _state(model) -> dict | None:
    """The model's persistent training state (`kmp.state_bytes`), without building an
    optimizer that has not been built (the audit changes nothing)."""
    from keras_mp.lean.memory import state_bytes

    try:
        return state_bytes(model, build=False).to_dict()
    except ValueError:
        return None


def _proposal(model, x, margin: float, model_fp32: bool):
    """The calibrated mixed_float16 plan for `model` on `x` (None where it cannot be made)."""
    import keras_mp.policies as policies
    from keras_mp.conversion.converter import convert, plan

    policy = model.dtype_policy
    default = getattr(policy, "default_policy", policy)
    keep = default.keep_fp32 if isinstance(default, policies.Policy) else None
    target = policies.Policy("mixed_float16", **({"keep_fp32": keep} if keep else {}))
    try:
        fp32 = model if model_fp32 else convert(model, "float32")
        return plan(fp32, target, calibrate=x, margin=margin)
    except Exception:  # noqa: BLE001 - the rest of the audit stands without it
        return None


def _suggest_scale(layers) -> float | None:
    """The largest power of two keeping every gradient at least 2x below 65504."""
    peak = max((v.grad_max_abs or 0.0 for la in layers for v in la.variables), default=0.0)
    if not peak:
        return None
    return 2.0 ** min(24, math.floor(math.log2(FP16_MAX / 2 / peak)))


def _range_pins(report: AuditReport) -> list:
    """The proposal's calibration pins on layers the audited model runs low."""
    proposal = report.proposal
    if proposal is None or proposal.calibration is None:
        return []
    float32 = {la.path for la in report.layers if la.compute_dtype == "float32"}
    if report.layers and all(la.compute_dtype == "float32" for la in report.layers):
        float32 = set()  # a float32 model: every proposed pin is news
    return [
        p
        for p in proposal.pins
        if p.reason.startswith(("calibration", "non-finite")) and p.path not in float32
    ]


def _conclude(
    report: AuditReport,
    model_fp32: bool,
    threshold: float,
    float16_grads: bool = True,
    tensor_cores: bool = True,
) -> None:
    advice = report.advice
    over = [la for la in report.layers if la.overflow_risk]
    low = [la for la in report.layers if la.runs_low]
    scale = report.loss_scale
    under = [
        (la, v)
        for la in report.layers
        for v in la.variables
        if float16_grads and (v.grad_underflow_at_scale or 0) > threshold
    ]
    too_big = [
        (la, v)
        for la in report.layers
        for v in la.variables
        if float16_grads and (v.grad_overflow_at_scale or 0) > 0
    ]
    pad = [la for la in report.layers if la.misaligned_dims] if tensor_cores else []
    proposed = _range_pins(report)
    if over and not proposed:
        first = over[0]
        advice.append(
            f"Layer {first.path or first.name!r} reaches |x| = {first.max_abs_activation:.3g}"
            " > 65504: in float16 its output becomes inf. Use 'mixed_bfloat16' (float32's "
            "range), or pin it to float32 (kmp.Policy(..., keep_fp32=[...]))."
        )
    if proposed:
        cal = report.proposal.calibration
        listed = ", ".join(f"{p.path!r} ({p.reason.split(': ', 1)[-1]})" for p in proposed[:4])
        more = f" and {len(proposed) - 4} more" if len(proposed) > 4 else ""
        cost = (
            ""
            if cal.fp32_flops is None
            else (f" ({100 * cal.fp32_flops:.1f}% of the matmul FLOPs in float32)")
        )
        advice.append(
            f"For float16, pin {len(proposed)} layer(s): {listed}{more}{cost}. "
            "kmp.convert(float32_model, 'mixed_float16', calibrate=data) does it; "
            "'mixed_bfloat16' needs none (float32's range)."
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
        better = (
            f" (about 2**{int(math.log2(suggested))})" if suggested and suggested > scale else ""
        )
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
            f"Pad {la.name!r} ({la.class_name}) dimensions {padded}: a GPU's tensor cores "
            "need multiples of 8."
        )
    if over or proposed:
        report.verdict = (
            "NOT safe in float16 as it is: activations overflow 65504"
            + (f"; calibrated conversion pins {len(proposed)} layer(s)" if proposed else "")
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
