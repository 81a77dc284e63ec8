"""Confirming calibration's pins by running the converted model.

`overflowing` runs a converted model on the calibration batches, watched as `measure`
watched the float32 one, and names the layers whose output is non-finite (or collapsed) in
the low dtype though fine in float32: what
`keras_mp.conversion.calibration.calibrated_plan` grows a pin for, one round at a time.
`pruned` then undoes each round the finite model shows it no longer needs.
"""

from __future__ import annotations

import math

import keras

from keras_mp.conversion.probe import trace

__all__ = ["overflowing", "pruned"]


def overflowing(new: keras.Model, items: list, ranges: dict) -> list:
    """`(address, itself)` for the layers whose output in `new` is non-finite though finite
    in the float32 model, or collapsed (its largest |value| off by more than 2x from float32's
    while its input's is within 2x: a norm whose variance overflowed to inf gives zeros), the
    first (innermost, earliest) first; `itself`: it received finite values (the failure is
    its own math)."""
    low: dict = {}  # address -> [largest |input|, largest |output|], in trace order
    for r in ranges.values():  # this conversion's, not an earlier round's
        r.low_output_max = None
    for x, _ in items:
        for rec in trace(new, x):
            fp32 = ranges.get(rec.address)
            if fp32 is None or rec.layer.compute_dtype == "float32":
                continue
            seen = low.setdefault(rec.address, [0.0, 0.0])
            seen[0], seen[1] = max(seen[0], rec.input_max), max(seen[1], rec.output_max)
            fp32.low_output_max = seen[1]
    bad = []
    for address, (low_in, low_out) in low.items():
        fp32 = ranges[address]
        if math.isinf(low_out) and math.isfinite(fp32.output_max):
            bad.append((address, math.isfinite(low_in)))
        elif _collapsed(fp32.input_max, low_in) is False and _collapsed(fp32.output_max, low_out):
            bad.append((address, True))
    return bad


def _collapsed(reference: float, value: float) -> bool | None:
    """Whether `value` is off from `reference` by more than 2x (None: too small to say)."""
    if not math.isfinite(reference) or reference < 1e-3 or not math.isfinite(value):
        return None
    return not 0.5 <= value / reference <= 2.0


def pruned(rounds, pins, tight, make_plan, convert, items, ranges, current) -> tuple:
    """`current` (plan, converted model) with every growth round undone that the converted
    model, run again, shows it no longer needs (a pin that a later, outer pin made moot: an
    attention layer grown before its block's own math, where the block made the NaN mask),
    the costliest first.

    Args:
        rounds: Per growth round, `(tight pins, range pins)` it added (`address -> reason`).
        pins: The range pins (changed in place: what is undone is removed).
        tight: The pins of layers alone (changed in place, likewise).
        make_plan: `() -> Plan` from the current `pins` and `tight`.
        convert: `Plan -> converted model`.
        items: The calibration batches, `(x, y)` pairs.
        ranges: The float32 model's `LayerRange`s (`overflowing` records the low maxima).
        current: `(plan, converted model)` with every round applied (finite).

    Returns:
        The `(plan, converted model)` with the rounds it does not need undone.
    """

    def fp32_flops() -> float:
        return sum(ranges[a].flops for a in make_plan().float32 if a in ranges)

    def undo(added):
        for a in added[0]:
            tight.pop(a, None)
        for a in added[1]:
            pins.pop(a, None)

    def redo(added):
        tight.update(added[0])
        pins.update(added[1])

    total, cost = fp32_flops(), []
    for i, added in enumerate(rounds):
        undo(added)
        cost.append((total - fp32_flops(), i))
        redo(added)
    for _, i in sorted(cost, reverse=True):  # the costliest, then the latest, first
        undo(rounds[i])
        low = {a: r.low_output_max for a, r in ranges.items()}
        trial = make_plan()
        try:
            new = convert(trial)
            clean = not overflowing(new, items, ranges)
        except Exception:  # noqa: BLE001 - the pin is needed: the model raises without it
            clean = False
        if clean:
            current = (trial, new)
            continue
        redo(rounds[i])
        for a, value in low.items():
            ranges[a].low_output_max = value
    return current
