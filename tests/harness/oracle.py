"""The oracle: runs a program under its low-precision setup and in float32, and classifies.

Outcomes (`Outcome.kind`):

- `ok`: trains within the tolerance of float32 (or fails the same way float32 does).
- `ok_warned`: differs, or the setup is wrong, but keras_mp warned (a `warnings.warn` issued
  by keras_mp's code; `ROUTINE` advice given whatever happens does not count) — for a
  divergence at a too-high learning rate the warning must name the learning rate.
- `ok_raised`: stopped with a deliberate error: the innermost frame is a `raise` statement
  in keras_mp (or, with no keras_mp frame on the way, in Keras), with a message.
- `silent`: a different result with no word: the final loss off float32's by more than
  the tolerance, NaN/inf where float32 is finite, a constant loss where float32's moves, a
  setup that is not what the user asked for (an explicit float32 pin overridden, float16
  left in a model converted to bfloat16, trainable weights that differ), finite training on
  out-of-range labels, a finite divergence at a too-high learning rate, a resumed run that
  differs from the uninterrupted one.
- `crash`: an exception whose innermost keras_mp frame is not a deliberate `raise`, or a raw
  TensorFlow/JAX/numpy error that float32 does not give.

Tolerance (calibrated in FINDINGS.md): the distance of the final epoch's loss from float32's,
`|L_low - L_32| / scale` with `scale = max(|L_first_32 - L_last_32|, 0.05 |L_first_32|)`
(float32's own progress, floored at 5% of its first loss), must stay under `TOLERANCE[format]`.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import os
import re

from . import families, programs

__all__ = ["Outcome", "TOLERANCE", "classify", "check", "distance"]

# Calibrated (FINDINGS.md, "Calibration", TensorFlow): known-good mixed programs (kmp.convert,
# fit, Adam, no event; one per family) measured at most 0.041 (mixed_float16), 0.014
# (mixed_bfloat16), 0.043 (lean_bfloat16); float32 against float32 with another weight seed,
# 0.007-0.77 (median 0.14, 15 programs). The tolerances sit 2.4x, 7x and 3.5x above the
# known-good maxima.
TOLERANCE = {"float16": 0.1, "bfloat16": 0.1, "lean": 0.15}
RESUME_TOLERANCE = 0.05  # save/load then continue vs. the uninterrupted run (same setup)
DIVERGED = 3 * math.log(families.CLASSES)  # a loss past 3x chance level has diverged
# keras_mp advice given whatever the result (the setup's choice of scaler): recorded, but it
# does not count as naming the fix of a different result
ROUTINE = (r"compiled with Keras' own LossScaleOptimizer",)
KMP_DIR = programs.KMP_DIR
KERAS_DIR = os.path.dirname(os.path.dirname(programs.keras.__file__)) + os.sep + "keras" + os.sep


@dataclasses.dataclass
class Outcome:
    """A program's classification, with the reason (a short cause) and the evidence."""

    kind: str  # ok, ok_warned, ok_raised, silent, crash
    reason: str
    program: str = ""
    evidence: dict = dataclasses.field(default_factory=dict)
    runs: dict = dataclasses.field(default_factory=dict, repr=False)  # both raw Runs

    @property
    def failed(self) -> bool:
        return self.kind in ("silent", "crash")

    def report(self) -> str:
        ev = self.evidence
        lines = [
            f"{self.kind.upper()}: {self.reason}",
            f"  program: {self.program}",
            f"  low  losses: {_fmt(ev.get('low_losses'))}",
            f"  fp32 losses: {_fmt(ev.get('ref_losses'))}",
        ]
        if ev.get("distance") is not None:
            lines.append(f"  distance: {ev['distance']:.3g} (tolerance {ev.get('tolerance')})")
        for w in ev.get("kmp_warnings", [])[:4]:
            lines.append(f"  keras_mp warning: {w[:300]}")
        for key in ("low_error", "ref_error"):
            if ev.get(key):
                lines.append(f"  {key}: {ev[key][:600]}")
        if ev.get("facts"):
            lines.append(f"  facts: {ev['facts']}")
        lines.append(
            "  repro: KERAS_BACKEND=" + ev.get("backend", "tensorflow") + " python -m "
            f"tests.harness.sweep --program '{self.program}'"
        )
        return "\n".join(lines)


def _fmt(losses) -> str:
    if not losses:
        return "-"
    return "[" + ", ".join(f"{v:.4g}" for v in losses) + "]"


def _finite(r: programs.Run) -> bool:
    return r.weights_finite and all(math.isfinite(v) for v in r.losses)


def distance(low: list[float], ref: list[float]) -> float:
    """The final loss' distance from float32's, in units of float32's progress (floored)."""
    scale = max(abs(ref[0] - ref[-1]), 0.05 * abs(ref[0]), 1e-12)
    return abs(low[-1] - ref[-1]) / scale


# keras_mp's wrappers of Keras' own methods (`import keras_mp` installs them): a frame of
# one at its call of the wrapped method only passes on what Keras raised.
PASS_THROUGH = {
    ("observe/fit_guard.py", "guarded"),
    ("scaling/optimizer_guard.py", "guarded"),
    ("scaling/optimizer_guard.py", "marked"),
    ("scaling/autoscale.py", "compile"),
}


def _pass_through(frame) -> bool:
    """Whether `frame` (file, line, function or None, text or None) is a wrapper's call."""
    path = os.path.relpath(frame[0], KMP_DIR).replace(os.sep, "/")
    text = frame[3] or linecache.getline(frame[0], int(frame[1])).strip()
    calls_wrapped = re.match(r"(return |result = )?\w+\(self, ", text)
    known = {(p, f) for p, f in PASS_THROUGH if frame[2] in (None, f)}
    return any(p == path for p, _ in known) and bool(calls_wrapped)


def _error_kind(err: dict) -> tuple[str, str]:
    """(kind, where): `kmp_raise`, `keras_raise`, `kmp_internal` or `raw`."""
    frames = err["frames"]
    ours = [f for f in frames if f[0].startswith(KMP_DIR) and not _pass_through(f)]
    where = lambda f: f"{os.path.relpath(f[0], os.path.dirname(KMP_DIR))}:{f[1]} ({f[2]})"
    deliberate = lambda f: f[3].startswith("raise ") and bool(err["message"].strip())
    innermost = frames[-1] if frames else None
    if ours:
        if ours[-1] is innermost and deliberate(innermost):
            return "kmp_raise", where(innermost)
        return "kmp_internal", where(ours[-1])
    # A TensorFlow graph error names where the failing op was defined
    defined = err.get("graph_sites") or re.findall(
        r"File \"([^\"]*keras_mp[^\"]*)\", line (\d+)", err["message"]
    )
    defined = [(p, line) for p, line in defined if not _pass_through((p, line, None, None))]
    if defined:
        path, line = defined[-1]
        site = f"{path.split('keras_mp' + os.sep, 1)[-1]}:{line} (graph op)"
        if re.search(r"assertion failed: \[kmp\.", err["message"]):
            return "kmp_raise", site  # keras_mp's own graph assertion, with its message
        return "kmp_internal", site
    if innermost and innermost[0].startswith(KERAS_DIR) and deliberate(innermost):
        return "keras_raise", where(innermost)
    return "raw", where(innermost) if innermost else "?"


def _summary(err: dict | None) -> str:
    if not err:
        return ""
    return f"{err['type']}: {err['message'][:400]}"


def _structure(p: programs.Program, low: programs.Run, ref: programs.Run) -> str | None:
    """A setup that is not what the user asked for, or None."""
    facts = low.facts
    if not facts:
        return None
    if p.policy.startswith("pin:") and facts.get("pinned") not in (None, "float32"):
        return (
            f"explicit dtype='float32' pin overridden: layer 'pinned' computes in {facts['pinned']}"
        )
    if p.low_dtype in ("bfloat16", "lean") and "float16" in facts.get("compute_dtypes", []):
        return "float16 left in a model set up for bfloat16 " + str(facts["compute_dtypes"])
    if p.low_dtype in ("bfloat16", "lean") and any(
        "float16" in n and "bfloat16" not in n for n in facts.get("input_policies", [])
    ):
        return f"InputLayer keeps {facts['input_policies']} after converting to {p.policy}"
    if p.low_dtype == "bfloat16" and p.wrap == "plain" and facts.get("dynamic_scale") is True:
        return "bfloat16 model gets a dynamic loss scaler (float16's) instead of the skip-only one"
    if ref.facts and facts.get("trainable") != ref.facts.get("trainable"):
        return (
            f"{facts.get('trainable')} trainable weights vs {ref.facts.get('trainable')} in float32"
        )
    return None


def classify(p: programs.Program, low: programs.Run, ref: programs.Run) -> Outcome:
    """Classifies the low-precision run `low` against the float32 run `ref` of program `p`."""
    kmp_warn = [w for w in low.kmp_warnings() if not any(re.search(r, w) for r in ROUTINE)]
    ev = {
        "backend": programs.keras.backend.backend(),
        "low_losses": low.losses,
        "ref_losses": ref.losses,
        "kmp_warnings": low.kmp_warnings(),
        "other_warnings": [m[:200] for _, m, ours in low.warnings if not ours][:5],
        "low_error": _summary(low.error),
        "ref_error": _summary(ref.error),
        "facts": low.facts,
        "tolerance": TOLERANCE[p.low_dtype],
    }
    out = lambda kind, reason: Outcome(kind, reason, p.describe(), ev)

    # 1. The low-precision run raised
    if low.error:
        kind, where = _error_kind(low.error)
        ev["error_at"] = where
        etype = low.error["type"]
        if kind == "kmp_raise":
            if p.event == "high_lr" and not re.search(r"learning[ _]rate", low.error["message"]):
                return out(
                    "silent",
                    f"too-high learning rate: keras_mp raises {etype} at {where}, never naming "
                    "the learning rate",
                )
            return out("ok_raised", f"keras_mp raises {etype} at {where}")
        if kind == "kmp_internal":
            return out("crash", f"{etype} inside keras_mp at {where}")
        if ref.error and ref.error["type"] == etype:
            return out("ok", f"same error as float32 ({etype})")
        if p.event == "bad_label" and re.search(r"label", low.error["message"], re.I):
            return out("ok_raised", f"{etype} naming the labels")
        if kind == "keras_raise":
            return out("ok_raised", f"Keras raises {etype} at {where} (float32 does not)")
        return out("crash", f"raw {etype} at {where} (float32 does not raise)")

    # 2. Float32 raised, the low-precision run did not
    if ref.error:
        if kmp_warn:
            return out("ok_warned", f"float32 raises {ref.error['type']}; keras_mp warned")
        if p.event == "bad_label" and not _finite(low):
            return out("ok", "out-of-range label: NaN (float32 raises)")
        return out("silent", f"float32 raises {ref.error['type']}; low precision trains, no word")

    # 3. Both ran: the setup, the event, then the numbers
    wrong_setup = _structure(p, low, ref)
    if wrong_setup:
        return out("ok_warned" if kmp_warn else "silent", wrong_setup)

    low_finite, ref_finite = _finite(low), _finite(ref)
    if p.event == "bad_label":
        if low_finite and not kmp_warn:
            return out("silent", "out-of-range label trains with a finite loss, no word")
        if kmp_warn:
            return out("ok_warned", "out-of-range label: keras_mp warned")
        return out("ok", "out-of-range label: NaN, as Keras gives")
    if p.event == "high_lr":
        diverged = not low_finite or low.losses[-1] > DIVERGED
        if not diverged:
            return out("ok", "learning rate too high but no divergence")
        named = [w for w in kmp_warn if re.search(r"learning[ _]rate", w, re.I)]
        if named:
            return out("ok_warned", "divergence; keras_mp names the learning rate")
        if kmp_warn:
            return out(
                "silent",
                "divergence at a too-high learning rate; the warning never names the learning rate",
            )
        return out("silent", "divergence at a too-high learning rate, no word")

    if not low_finite:
        if not ref_finite:
            return out("ok", "non-finite as in float32")
        if low.weights_finite and p.event == "nan_sample":
            # the NaN shows in the logged loss, the step is skipped; float32's kernel
            # swallowed the NaN (max(NaN, 0) in its relu)
            return out("ok", "NaN sample: loss shows NaN, weights kept finite")
        return out(
            "ok_warned" if kmp_warn else "silent",
            "NaN/inf losses or weights where float32 is finite",
        )
    if not ref_finite:
        return out("ok", "finite where float32 is not (non-finite steps skipped)")

    d = distance(low.losses, ref.losses)
    ev["distance"] = d
    ref_moves = abs(ref.losses[0] - ref.losses[-1]) > 1e-3 * abs(ref.losses[0])
    stuck = max(low.losses) - min(low.losses) <= 1e-7 * abs(low.losses[0])
    if stuck and ref_moves:
        return out("ok_warned" if kmp_warn else "silent", "loss constant while float32's moves")
    if d > TOLERANCE[p.low_dtype]:
        return out(
            "ok_warned" if kmp_warn else "silent",
            f"final loss off float32's by {d:.2f} (tolerance {TOLERANCE[p.low_dtype]})",
        )
    if low.uninterrupted is not None:
        r = distance(low.losses, low.uninterrupted)
        ev["resume_distance"] = r
        if r > RESUME_TOLERANCE:
            return out(
                "silent",
                f"save/load mid-run then continue differs from the uninterrupted run by {r:.2f}",
            )
    return out("ok", f"within tolerance ({d:.2f})")


_REFS: dict[tuple, programs.Run] = {}


def check(p: programs.Program, ref_cache: bool = True) -> Outcome:
    """Runs `p` under its setup and in float32 (memoised per program without the policy)."""
    key = (programs.keras.backend.backend(), p.ref_key)
    ref = _REFS.get(key) if ref_cache else None
    if ref is None:
        ref = programs.run(p, precision="float32")
        _REFS[key] = ref
    low = programs.run(p)
    outcome = classify(p, low, ref)
    outcome.runs = {"low": dataclasses.asdict(low), "ref": dataclasses.asdict(ref)}
    return outcome
