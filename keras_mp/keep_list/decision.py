"""The decision a plan records: which layers run in float32, and why."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["ALONE", "Pin", "Plan"]

# The note of a pin of a layer's own math only: its sublayers keep their own dtype.
ALONE = "its own math only"


@dataclasses.dataclass(frozen=True)
class Pin:
    """One layer a plan runs in float32.

    Attributes:
        path: the layer's path (its name where it has none).
        class_name: its class.
        reason: why: the keep-list entry, `"source model"` (float32 in a low-precision
            source model), or a calibration finding.
        note: how the pin was placed, e.g. lifted from a sublayer.
        cost: its share of the model's matmul FLOPs, where measured (calibration, the
            run check).
    """

    path: str
    class_name: str
    reason: str
    note: str = ""
    cost: float | None = None


@dataclasses.dataclass
class Plan:
    """Which layers of a model run in float32 under a policy, and why.

    `plan()` makes it; `keras_mp.convert` applies it. `str(plan)` lists the pins;
    `to_dict()` gives the same as plain data.

    Attributes:
        policy: the `keras_mp.Policy`.
        pins: the `Pin`s, outermost pinned layers only (their sublayers follow them).
        swaps: stock layers replaced by their keras_mp versions (`address -> class`).
        notes: decisions worth knowing (lifted pins, output blocks left alone).
        float32: addresses (see `addresses`) of every layer that runs in float32: the
            pins and their sublayers.
        calibration: the `keras_mp.conversion.calibration.Calibration` behind a calibrated plan.
        check: the `keras_mp.conversion.runcheck.RunCheck` of the run check, if it ran.
    """

    policy: Any
    pins: list = dataclasses.field(default_factory=list)
    swaps: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)
    float32: set = dataclasses.field(default_factory=set, repr=False)
    calibration: Any = dataclasses.field(default=None, repr=False)
    check: Any = dataclasses.field(default=None, repr=False)

    @property
    def policy_name(self) -> str:
        return self.policy.name

    def to_dict(self) -> dict:
        return {
            "policy": self.policy_name,
            "pins": [dataclasses.asdict(p) for p in self.pins],
            "swaps": dict(self.swaps),
            "notes": list(self.notes),
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "check": None if self.check is None else self.check.to_dict(),
        }

    def __str__(self) -> str:
        lines = [f"Conversion to {self.policy_name!r}: {len(self.pins)} layer(s) pinned to float32"]
        for p in self.pins:
            note = f"; {p.note}" if p.note else ""
            if p.cost is not None:
                note += f"; {100 * p.cost:.1f}% of the matmul FLOPs"
            lines.append(f"  {p.path} ({p.class_name}): {p.reason}{note}")
        if self.swaps:
            lines.append(f"  {len(self.swaps)} stock layer(s) replaced by keras_mp versions")
        lines += [f"  note: {n}" for n in self.notes]
        if self.calibration is not None:
            lines += ["  " + line for line in self.calibration.summary()]
        if self.check is not None:
            lines += ["  " + line for line in self.check.summary()]
        return "\n".join(lines)
