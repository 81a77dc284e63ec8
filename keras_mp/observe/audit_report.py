"""What `kmp.audit` returns: per-variable, per-layer and whole-model findings, as a table."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["AuditReport", "LayerAudit", "VariableAudit"]


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
        proposal: the calibrated mixed_float16 `Plan` on the audit's batch (`kmp.plan`), or
            None: the layers to pin, with their measured maxima and FLOP cost.
        verdict: one line.
        advice: concrete actions.
        state_bytes: the persistent training state (`kmp.state_bytes(model).to_dict()`:
            weights, compensation, optimizer, scaler, total and `per_parameter`).
    """

    model_name: str
    loss_scale: float
    loss_scale_source: str
    layers: list
    notes: list
    converted: bool = False
    proposal: Any = None
    verdict: str = ""
    advice: list = dataclasses.field(default_factory=list)
    state_bytes: dict | None = None

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
        proposal = self.proposal
        self.proposal = None  # a Plan holds its Policy: converted on its own
        try:
            result = dataclasses.asdict(self)
        finally:
            self.proposal = proposal
        result["proposal"] = None if proposal is None else proposal.to_dict()
        return result

    def __str__(self) -> str:
        def num(x, fmt="{:.3g}"):
            return "-" if x is None else fmt.format(x)

        def pct(x):
            return "-" if x is None else f"{100 * x:.1f}%"

        header = (
            "layer",
            "class",
            "compute/var",
            "fp32?",
            "max|act|",
            "grad uflow@1",
            f"@{self.loss_scale:g}",
            "dims%8",
        )
        rows = []
        for la in self.layers:
            rows.append(
                (
                    la.path or la.name,
                    la.class_name,
                    f"{la.compute_dtype}/{la.variable_dtype}",
                    ("LOW! " if la.runs_low else "") + (la.fp32_reason or "") or "-",
                    num(la.max_abs_activation) + (" >FP16!" if la.overflow_risk else ""),
                    pct(la.worst("grad_underflow_at_1")),
                    pct(la.worst("grad_underflow_at_scale")),
                    "-"
                    if not la.matmul_dims
                    else (
                        "ok"
                        if not la.misaligned_dims
                        else "pad " + ",".join(map(str, la.misaligned_dims))
                    ),
                )
            )
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        out = [
            f"Precision audit of {self.model_name!r} (loss scale {self.loss_scale:g}, "
            f"{self.loss_scale_source})",
            line(header),
            line(["-" * w for w in widths]),
        ]
        out += [line(r) for r in rows]
        out += [f"note: {n}" for n in self.notes]
        if self.state_bytes:
            sb = self.state_bytes
            out.append(
                f"training state: {sb['per_parameter']:.2f} bytes/parameter "
                f"({sb['total'] / 2**20:.2f} MiB: weights {sb['weights'] / 2**20:.2f}, "
                f"compensation {sb['compensation'] / 2**20:.2f}, optimizer "
                f"{sb['optimizer'] / 2**20:.2f}, scaler {sb['scaler'] / 2**20:.4f})"
            )
        out += ["", f"Verdict: {self.verdict}"]
        out += [f"  - {a}" for a in self.advice]
        return "\n".join(out)
