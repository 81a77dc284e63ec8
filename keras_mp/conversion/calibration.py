"""Calibration: the layers that leave the compute dtype's range on the user's own data.

`measure(model, data)` runs the float32 model on a few batches with every layer watched
(`keras_mp.conversion.probe.trace`): the largest |value| each layer receives and produces, nested
layers and sublayers of blocks included, and each layer's matmul FLOPs. `range_pins` turns
that into pins: a layer is pinned when a tensor it receives or produces exceeds the compute
dtype's largest finite value divided by `margin` (65504 / 4 = 16376 for float16 by default).
With a loss (given, or the compiled one) and targets, the gradient range of every layer's
output is measured too (at loss scale 1: the dynamic scaler lowers the scale until the
scaled gradients fit, so only a gradient past the limit at scale 1 needs a pin).
A residual stream is no layer's output, but every layer downstream receives it: the blocks
it flows through and the norm that finally tames it are pinned, and the pinned outputs stay
in float32 from one pinned layer to the next. Under bfloat16 (float32's range) nothing is
pinned for range. `keras_mp.convert(..., calibrate=data)` applies the pins with the
keep-list's rules (a pin inside a block pins the block) and then checks the converted model
on the same batches: where a layer's output is non-finite in the low dtype though finite in
float32 (an internal tensor overflowed), the smallest pin that the check confirms is kept:
the layer alone when it overflowed itself (a norm whose statistics run in the input dtype),
else the layer whose own math fed it the non-finite tensor (an attention layer's mask,
bias and scores), alone, its projections left in the low dtype; then that layer with its
query and key projections; only then its whole block (`calibrated_plan`). A layer pinned
alone gets its low sublayers' outputs cast to float32 (`keras_mp.conversion.boundary`), so a block
that adds them to its own float32 tensors with raw TensorFlow ops (T5Gemma, RWKV-7) runs.
Once the converted model is finite, each growth round is undone in turn, the costliest
first, where the model, run again, stays finite without it (a pin that a later, outer pin
made moot).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import keras
import ml_dtypes
import numpy as np

import keras_mp.keep_list as keep_list
from keras_mp.conversion.confirm import overflowing, pruned
from keras_mp.conversion.probe import activation_gradients, matmul_flops, trace, unpack
from keras_mp.conversion.trial import forward_failure

__all__ = [
    "Calibration",
    "LayerRange",
    "batches",
    "calibrated_plan",
    "check_margin",
    "flop_shares",
    "limit",
    "loss_function",
    "measure",
    "range_pins",
]

DEFAULT_MARGIN = 4.0
_MAX_BATCHES = 8


def _finite_max(dtype: str) -> float:
    return float(ml_dtypes.finfo(dtype).max if dtype == "bfloat16" else np.finfo(dtype).max)


def limit(compute_dtype: str, margin: float) -> float:
    """The largest |value| calibration lets a `compute_dtype` tensor reach: max / margin."""
    return _finite_max(compute_dtype) / margin


def batches(data: Any, max_batches: int = _MAX_BATCHES) -> list:
    """The calibration batches in `data`, as `(x, y)` pairs (`y` may be None).

    `data` is one batch (`x`, or `(x, y)`), a list of batches, or an iterable of batches
    (a `tf.data.Dataset`, a generator, a `PyDataset`), of which the first `max_batches`
    are used.
    """
    if isinstance(data, list) and data and not isinstance(data[0], (int, float)):
        items = data[:max_batches]
    elif isinstance(data, (tuple, dict, np.ndarray)) or hasattr(data, "shape"):
        items = [data]
    else:
        items = []
        for item in data:
            items.append(item)
            if len(items) == max_batches:
                break
    if not items:
        raise ValueError("calibrate: `data` holds no batch.")
    out = []
    for item in items:
        x, y, _ = unpack(item)
        out.append((x, y))
    return out


@dataclasses.dataclass
class LayerRange:
    """What calibration measured for one layer (over every batch and call).

    Attributes:
        path: the layer's address.
        class_name: its class.
        input_max: largest |value| it received (inf if non-finite).
        output_max: largest |value| it produced.
        flops: its own matmul/convolution FLOPs on one batch (see `_probe.matmul_flops`).
        low_output_max: largest |output| in the converted model (None: not checked).
        grad_max: largest |d loss / d output| at loss scale 1 (None: no loss given).
    """

    path: str
    class_name: str
    input_max: float = 0.0
    output_max: float = 0.0
    flops: float = 0.0
    low_output_max: float | None = None
    grad_max: float | None = None


@dataclasses.dataclass
class Calibration:
    """The measurements behind a calibrated plan, and their cost.

    Attributes:
        compute_dtype: the dtype whose range was checked.
        margin: the safety factor: the limit is the dtype's largest value / margin.
        limit: that limit.
        batches: how many batches were measured.
        ranges: `LayerRange` per layer address.
        pinned: `address -> reason` for the layers pinned for range (a pin inside a block
            pins the block).
        tight: `address -> reason` for the layers pinned alone (their own math; their
            sublayers keep the low dtype), each confirmed by running the converted model.
        checked: whether the converted model was run on the batches to confirm it.
        fp32_flops: share of the model's matmul FLOPs that run in float32 (every pin).
        range_flops: share of them that calibration's pins added.
    """

    compute_dtype: str
    margin: float
    limit: float
    batches: int
    ranges: dict = dataclasses.field(default_factory=dict)
    pinned: dict = dataclasses.field(default_factory=dict)
    tight: dict = dataclasses.field(default_factory=dict)
    checked: bool = False
    fp32_flops: float | None = None
    range_flops: float | None = None

    def worst(self, path: str) -> float:
        r = self.ranges[path]
        return max(r.input_max, r.output_max)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> list:
        """Lines for a report: the limit, how many pins, their cost (the pins themselves,
        with their measured maxima, are the plan's)."""
        lines = [
            f"calibration: {self.batches} batch(es), limit {self.limit:,.0f} "
            f"({self.compute_dtype} max / margin {self.margin:g}); "
            f"{len(self.pinned) + len(self.tight)} layer(s) pinned for range"
            + ("" if self.checked else " (converted model not checked on this backend)")
        ]
        if self.fp32_flops is not None:
            lines.append(
                f"cost: {100 * self.fp32_flops:.1f}% of the matmul FLOPs run in float32 "
                f"({100 * (self.range_flops or 0):.1f}% for range)"
            )
        return lines


def loss_function(model: keras.Model, loss: Any):
    """`(x, y, y_pred) -> loss` from a Keras loss (object, name or function), or the
    compiled loss when `loss` is None; None when there is neither."""
    if loss is not None:
        fn = keras.losses.get(loss)
        return lambda x, y, y_pred: keras.ops.mean(fn(y, y_pred))
    if getattr(model, "compiled", False) and getattr(model, "loss", None) is not None:
        return lambda x, y, y_pred: model.compute_loss(x, y, y_pred, training=False)
    return None


def measure(
    model: keras.Model, data: Any, max_batches: int = _MAX_BATCHES, loss: Any = None
) -> dict:
    """Per layer address, the largest |input| and |output| over the batches, and FLOPs.

    Args:
        model: A built model (run as it is: measure the float32 model).
        data: Batches, as for `batches`.
        max_batches: At most this many batches are used.
        loss: A Keras loss: with targets in the batches, also the gradient range (the
            largest |d loss / d output| of each layer, at loss scale 1). Default: the
            compiled loss, if any.

    Returns:
        `{address: LayerRange}`.
    """
    ranges: dict = {}
    loss_fn = loss_function(model, loss)
    for x, y in batches(data, max_batches):
        for rec in trace(model, x):
            r = ranges.get(rec.address)
            if r is None:
                r = ranges[rec.address] = LayerRange(rec.address, type(rec.layer).__name__)
                r.flops = matmul_flops(rec) * rec.calls
            r.input_max = max(r.input_max, rec.input_max)
            r.output_max = max(r.output_max, rec.output_max)
        if loss_fn is not None and y is not None:
            for address, g in activation_gradients(model, x, y, loss_fn).items():
                if address in ranges:
                    r = ranges[address]
                    r.grad_max = g if r.grad_max is None else max(r.grad_max, g)
    return ranges


def range_pins(ranges: dict, compute_dtype: str, margin: float) -> dict:
    """`address -> reason` for the layers that receive or produce a tensor past the limit.

    Args:
        ranges: From `measure`.
        compute_dtype: The low dtype ("float16", "bfloat16").
        margin: Safety factor (> 1): the limit is the dtype's largest value / margin.

    Returns:
        The reasons, each with the measured maximum against the limit.
    """
    bound = limit(compute_dtype, margin)
    pins = {}
    for path, r in ranges.items():
        side, value = max(
            ("output", r.output_max),
            ("input", r.input_max),
            ("gradient", r.grad_max or 0.0),
            key=lambda pair: pair[1],
        )
        if bound < value < math.inf:  # inf: broken in float32 already, pinning cannot help
            pins[path] = f"calibration: max |{side}| = {value:,.0f} > {bound:,.0f}"
    return pins


def check_margin(margin: Any) -> float:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
        raise ValueError(f"calibrate: `margin` must be a number >= 1. Received: {margin!r}")
    return float(margin)


def flop_shares(ranges: dict, float32: Iterable, range_only: Iterable) -> tuple:
    """(share of FLOPs in float32, share added by calibration), or (None, None)."""
    total = sum(r.flops for r in ranges.values())
    if not total:
        return None, None
    f32 = sum(ranges[a].flops for a in set(float32) if a in ranges)
    extra = sum(ranges[a].flops for a in set(range_only) if a in ranges)
    return f32 / total, extra / total


_INTERNAL = "non-finite in {dtype} though finite in float32: a tensor inside it overflows"
_ROUNDS = 24  # checks of the converted model, each pinning at the first layer to overflow
_SCORE_NAMES = ("query", "key", "q_proj", "k_proj", "q_dense", "k_dense")


def _score_projections(layer) -> list:
    """An attention layer's query and key projections (by name), if it has them."""
    found = []
    for child in keep_list.sublayers(layer):
        name = child.name.lower()
        if any(n in name for n in _SCORE_NAMES) and "value" not in name:
            found.append(child)
    return found


def calibrated_plan(model, policy, data, margin, max_batches, loss, convert) -> tuple:
    """The calibrated plan, and the converted model checked on the batches (or None).

    Range pins are placed with the keep-list's rules. Then the model is converted and run
    (float16 only: bfloat16 has float32's range); where a layer's output is non-finite
    though finite in float32, the pin grows one step a round, each checked by running:
    (0) the layer alone if it overflowed itself, else the layer that fed it the non-finite
    tensor (its parent), alone, with the other layers of its class (same code); (1) with
    its query and key projections (the attention scores); (2) its whole block, lifted as
    the keep-list lifts. Then the rounds that the finite model no longer needs are undone
    (`keras_mp.conversion.confirm.pruned`).

    Args:
        model: The float32 model.
        policy: A `keras_mp.Policy`.
        data: The batches (see `batches`).
        margin: The safety factor.
        max_batches: At most this many batches.
        loss: A loss for the gradient range (see `measure`).
        convert: `Plan -> converted model`.

    Returns:
        `(plan, converted model or None)`; the plan's `calibration` has the measurements,
        the pins and their FLOP shares.
    """
    margin = check_margin(margin)
    items = batches(data, max_batches)
    ranges = measure(model, items, loss=loss)
    low = policy.compute_dtype
    pins = range_pins(ranges, low, margin) if policy.is_low_precision else {}
    cal = Calibration(low, margin, limit(low, margin), len(items), ranges, pins)
    layers, parents = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    layer_at = {where[id(x)]: x for x in layers}
    steps: dict = {}  # address -> how far its pin has grown

    def make_plan():
        extra = [(layer_at[a], reason) for a, reason in pins.items() if a in layer_at]
        exact = [(layer_at[a], reason) for a, reason in cal.tight.items() if a in layer_at]
        result = keep_list.plan(model, policy, extra=extra, exact=exact)
        result.calibration = cal
        return result

    def grow(layer, reason=None):
        address, reason = where[id(layer)], reason or _INTERNAL.format(dtype=low)
        step = steps[address] = steps.get(address, -1) + 1
        if step == 1 and not _score_projections(layer):
            step = steps[address] = 2
        if step == 0:
            same = [x for x in layers if type(x) is type(layer)]
            for x in same if not type(layer).__module__.startswith("keras.") else [layer]:
                steps.setdefault(where[id(x)], 0)
                cal.tight[where[id(x)]] = reason
        elif step == 1:
            for x in _score_projections(layer):
                cal.tight[where[id(x)]] = f"{reason} (the scores of {address!r})"
        elif step == 2:  # the layer and its sublayers, not lifted
            for x in layer._flatten_layers(include_self=False):
                if id(x) in where:
                    cal.tight.setdefault(where[id(x)], f"{reason} (inside {address!r})")
        else:
            pins[address] = reason

    rounds: list = []  # per growth: the (tight, range) pins it added

    def grown(step, *args):
        tight, wide = dict(cal.tight), dict(pins)
        step(*args)
        rounds.append(
            (
                {a: r for a, r in cal.tight.items() if a not in tight},
                {a: r for a, r in pins.items() if a not in wide},
            )
        )

    the_plan, new, last = make_plan(), None, []
    if low == "float16":
        for _ in range(_ROUNDS):
            new = convert(the_plan)
            try:
                bad = overflowing(new, items, ranges)
            except Exception as e:  # noqa: BLE001 - e.g. JAX's CPU has no float16 dot
                # A pin's float32 tensor may meet low-precision math (a raw op on both):
                # the layer that raised grows (or, if low, runs its own math in float32).
                failed = forward_failure(new, items[0][0]) if last else None
                if failed is not None and failed.address in layer_at:
                    grown(
                        grow,
                        layer_at[failed.address],
                        f"{failed.error[:100]} (after a calibration pin)",
                    )
                    the_plan, new = make_plan(), None
                    continue
                the_plan.notes.append(f"converted model not checked here ({type(e).__name__})")
                new = None
                break
            if not bad:
                cal.checked = True
                break
            # The first layer to overflow is the source; what follows only inherits inf.
            address, itself = bad[0]
            layer = layer_at.get(address)
            parent = parents.get(id(layer)) if layer is not None else None
            if layer is None:
                grown(pins.__setitem__, address, _INTERNAL.format(dtype=low))
            else:
                last.append(
                    layer if itself or parent is None or isinstance(parent, keras.Model) else parent
                )
                grown(grow, last[-1])
            the_plan, new = make_plan(), None
        if cal.checked and len(rounds) > 1:
            the_plan, new = pruned(
                rounds, pins, cal.tight, make_plan, convert, items, ranges, (the_plan, new)
            )
    cal.tight = {a: r for a, r in cal.tight.items() if a in the_plan.float32}
    base = keep_list.plan(model, policy).float32
    cal.fp32_flops, cal.range_flops = flop_shares(ranges, the_plan.float32, the_plan.float32 - base)
    if new is not None:
        new.precision_plan = the_plan
    return the_plan, new
