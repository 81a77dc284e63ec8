"""Loading fingerprints and classifying two runs: `load`, `diff`, `DiffReport`.

The public names are re-exported by `keras_mp.fingerprint`, whose docstring states the
rounding bound. This module needs only numpy (the `keras-mp diff` command uses it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

__all__ = [
    "FORMAT",
    "LOSS_FACTOR",
    "ROUNDING_FACTOR",
    "VERSION",
    "DiffReport",
    "FingerprintError",
    "diff",
    "load",
]

FORMAT = "keras_mp.fingerprint"
VERSION = 1
ROUNDING_FACTOR = 8.0
LOSS_FACTOR = 0.1
# Unit roundoff (half the gap above 1.0) of the formats a model computes or stores in.
_UNIT_ROUNDOFF = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8_e4m3fn": 2.0**-4,
    "float8_e5m2": 2.0**-3,
}
_META_KEYS = (  # settings worth naming when they differ, in that order
    "backend",
    "policy",
    "compute_dtypes",
    "jit_compile",
    "optimizer",
    "replicas",
    "tf_op_determinism",
    "deterministic",
    "env",
    "versions",
    "machine",
    "every_n_steps",
)


class FingerprintError(ValueError):
    """A fingerprint that cannot be read or compared (the message is one line)."""


@dataclasses.dataclass(frozen=True)
class DiffReport:
    """The classification of two runs by `diff`.

    Attributes:
        verdict: `"identical"` (every recorded hash, loss, scale and skip agrees),
            `"rounding"` (within the rounding bound at every common record, losses within
            their tolerance, same skips and scale) or `"diverged"`.
        step: diverged: the first step known to differ (a skip or loss that differs
            locates it inside a record interval; else the record step); else None.
        variable: diverged: the first variable, in model order, beyond its own bound at
            `record_step` (else the first that differs); rounding: the one closest to its
            own bound.
        cause: diverged: the likely cause, one sentence; else None.
        distance: the L2 distance between the two runs' weights (all variables as one
            vector) at `record_step`.
        bound: the rounding bound for `distance`.
        variable_distance: `variable`'s own distance.
        variable_bound: `variable`'s own bound.
        record_step: the record at which the distances were taken (diverged: the first
            record at or after `step`; rounding: the record closest to the bound).
        loss_step: the first step whose loss differs beyond its tolerance, if any.
        evidence: further findings, one sentence each.
        context: the settings the runs differ in (backend, XLA, env, versions...).
        steps_compared: the number of records compared.
        unit_roundoff: the compute format's unit roundoff used in the bound.
    """

    verdict: str
    step: int | None = None
    variable: str | None = None
    cause: str | None = None
    distance: float = 0.0
    bound: float = 0.0
    variable_distance: float = 0.0
    variable_bound: float = 0.0
    record_step: int | None = None
    loss_step: int | None = None
    evidence: tuple = ()
    context: tuple = ()
    steps_compared: int = 0
    unit_roundoff: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        weights = (
            f"weights' distance {self.distance:.3g} vs bound {self.bound:.3g} "
            f"({_ratio(self.distance, self.bound)}) at step {self.record_step}"
        )
        own = (
            f"{self.variable!r}: {self.variable_distance:.3g} vs its bound "
            f"{self.variable_bound:.3g}"
            if self.variable
            else ""
        )
        if self.verdict == "identical":
            lines = [f"identical: {self.steps_compared} records agree bit for bit"]
        elif self.verdict == "rounding":
            lines = [f"rounding: same trajectory up to rounding over {self.steps_compared} records"]
            if self.variable is not None:
                lines.append(f"  closest to the bound: {weights}; nearest its own bound: {own}")
        else:
            lines = [
                f"diverged at step {self.step}"
                + (f", first in variable {self.variable!r}" if self.variable else "")
            ]
            lines.append(f"  likely cause: {self.cause}")
            if self.variable is not None:
                lines.append(f"  {weights}; {own}")
        lines += [f"  - {e}" for e in self.evidence]
        if self.context:
            lines.append("  the runs differ in: " + "; ".join(self.context))
        return "\n".join(lines)


def _ratio(d: float, b: float) -> str:
    if not math.isfinite(d):
        return "non-finite, or an integer variable whose bytes differ"
    return f"{d / b:.2g}x the bound" if b > 0 else "no motion to allow rounding"


# -- loading --------------------------------------------------------------------------


def load(source, name: str | None = None) -> dict:
    """Reads and checks a fingerprint.

    Args:
        source: a path to a JSON file, a dict, or an object with `to_dict()`
            (`Recorder`, `Fingerprint`).
        name: what to call it in error messages (default: the path).

    Returns:
        The fingerprint as a dict.

    Raises:
        FingerprintError: the file is missing, not JSON, or not a fingerprint.
    """
    if hasattr(source, "to_dict"):
        data, name = source.to_dict(), name or type(source).__name__
    elif isinstance(source, dict):
        data, name = source, name or "fingerprint"
    else:
        path = os.fspath(source)
        name = name or path
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FingerprintError(f"{name}: no such file") from None
        except IsADirectoryError:
            raise FingerprintError(f"{name}: is a directory, not a fingerprint file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f" at line {e.lineno}" if hasattr(e, "lineno") else ""
            raise FingerprintError(
                f"{name}: not valid JSON{where} (truncated or corrupt?)"
            ) from None
    _check(data, name)
    return data


def _check(data, name: str) -> None:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise FingerprintError(f"{name}: not a keras_mp fingerprint (no format {FORMAT!r})")
    if data.get("version") != VERSION:
        raise FingerprintError(
            f"{name}: fingerprint version {data.get('version')!r}, this keras_mp reads {VERSION}"
        )
    variables, records = data.get("variables"), data.get("records")
    if not isinstance(variables, list) or not isinstance(records, list):
        raise FingerprintError(f"{name}: 'variables' and 'records' must be lists")
    if not records:
        raise FingerprintError(f"{name}: no records (did training run?)")
    m = data.get("meta", {}).get("sketch_size")
    for r in records:
        vs = r.get("vars") if isinstance(r, dict) else None
        if (
            not isinstance(r.get("step"), int)
            or not isinstance(vs, list)
            or len(vs) != len(variables)
            or any(len(v) != 5 or len(v[4]) != m for v in vs)
        ):
            raise FingerprintError(f"{name}: malformed record {r.get('step', '?')!r}")


def _same_model(a: dict, b: dict) -> None:
    va, vb = a["variables"], b["variables"]
    if len(va) != len(vb):
        raise FingerprintError(
            f"fingerprints of different models: A has {len(va)} variables, B has {len(vb)}"
        )
    for i, (x, y) in enumerate(zip(va, vb)):
        if x["shape"] != y["shape"] or x["dtype"] != y["dtype"]:
            raise FingerprintError(
                f"fingerprints of different models: variable {i} is {x['path']!r} "
                f"{tuple(x['shape'])} {x['dtype']} in A, {y['path']!r} {tuple(y['shape'])} "
                f"{y['dtype']} in B"
            )
    if a["meta"].get("sketch_size") != b["meta"].get("sketch_size"):
        raise FingerprintError("fingerprints with different sketch sizes cannot be compared")


# -- the comparison -------------------------------------------------------------------


def _flatten(meta: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in meta.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(v) -> str:
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _context(a: dict, b: dict) -> list:
    fa, fb = _flatten(a), _flatten(b)
    return [
        f"{key}: {_show(fa.get(key))} vs {_show(fb.get(key))}"
        for key in sorted(
            set(fa) | set(fb),
            key=lambda k: (
                _META_KEYS.index(k.split(".")[0])
                if k.split(".")[0] in _META_KEYS
                else len(_META_KEYS),
                k,
            ),
        )
        if fa.get(key) != fb.get(key)
    ]


def diff(a, b, *, factor: float = ROUNDING_FACTOR, loss_factor: float = LOSS_FACTOR) -> DiffReport:
    """Classifies two runs' fingerprints: identical, same up to rounding, or diverged.

    Records are compared at the steps both runs recorded, in order. Between records, the
    loss of every step is compared (tolerance: `loss_factor` times the median
    step-to-step change of the loss, or one unit roundoff of it, whichever is larger) and
    so are the skipped steps; at each record, every variable's distance (from the
    sketches) is compared with its rounding bound (`keras_mp.fingerprint`'s docstring),
    and the loss scale must agree exactly. The first failure is where the runs diverged.
    Runs whose optimizer settings differ are never "rounding".

    Args:
        a: the first fingerprint (path, dict, `Recorder` or `Fingerprint`).
        b: the second.
        factor: the constant `C` of the bound (default `ROUNDING_FACTOR`).
        loss_factor: the share of the loss' step-to-step spread that a loss may differ
            by (default `LOSS_FACTOR`).

    Returns:
        A `DiffReport` (print it, or `to_dict()`).

    Raises:
        FingerprintError: unreadable input, different models or no common step.

    Example:

    >>> report = kmp.fingerprint.diff("run_a.json", "run_b.json")  # doctest: +SKIP
    >>> report.verdict, report.step, report.variable  # doctest: +SKIP
    ('diverged', 7, 'sequential/dense/kernel')
    """
    from keras_mp.fingerprint.classify import Run, classify

    da = load(a, None if isinstance(a, (str, os.PathLike)) else "A")
    db = load(b, None if isinstance(b, (str, os.PathLike)) else "B")
    _same_model(da, db)
    A, B = Run(da), Run(db)
    common = sorted(set(A.records) & set(B.records))
    if not common:
        raise FingerprintError(
            f"no step recorded in both runs (A: steps {min(A.records)}-{max(A.records)}, "
            f"B: {min(B.records)}-{max(B.records)})"
        )
    variables = da["variables"]
    compute = set(A.meta.get("compute_dtypes") or ["float32"]) | set(
        B.meta.get("compute_dtypes") or ["float32"]
    )
    u_c = max(_UNIT_ROUNDOFF.get(str(d), 0.0) for d in compute) or _UNIT_ROUNDOFF["float32"]
    u_w = np.array([_UNIT_ROUNDOFF.get(v["dtype"], 0.0) for v in variables])
    size = np.array([max(math.prod(v["shape"]), 1) for v in variables], dtype=np.float64)
    context = _context(A.meta, B.meta)
    recipe = [c for c in context if c.startswith("optimizer.")]
    fields = classify(A, B, common, variables, u_c, u_w, size, factor, loss_factor, recipe)
    return DiffReport(**fields, context=tuple(context), unit_roundoff=u_c)
