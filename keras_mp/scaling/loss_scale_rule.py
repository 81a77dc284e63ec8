"""The loss-scale rule: its constants, its state and one pure update of them.

`update_loss_scale` is a pure function of (state, grads-finite) -> state written in
`keras.ops`, so it runs inside the compiled train step on every backend with no host
synchronisation (the model: jmp's `adjust()`). Its invariants: the scale stays finite and
within [min_scale, max_scale]; the state says whether the step's update may be applied (a
non-finite step changes no weight and no optimizer slot). `kmp.LossScaleOptimizer`
(keras_mp/scaling/loss_scale.py) keeps the state as optimizer variables and runs this rule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np
from keras import ops

__all__ = [
    "LossScaleConfig",
    "LossScaleState",
    "initial_loss_scale_state",
    "update_loss_scale",
]


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """The constants of a loss-scaling rule, validated on construction.

    Args:
        initial_scale: starting scale, within `[min_scale, max_scale]`.
        growth_interval: consecutive finite steps after which the scale grows.
        growth_factor: factor (> 1) applied on growth.
        backoff_factor: factor in (0, 1) applied when the hysteresis is exhausted.
        min_scale: floor of the scale (> 0).
        max_scale: ceiling of the scale (finite, >= min_scale).
        hysteresis: overflowing steps tolerated before backing off (>= 1); it is
            restored whenever the scale grows (as in Megatron-LM).
        dynamic: `False` keeps the scale at `initial_scale` forever; non-finite
            steps are still skipped and counted.
    """

    initial_scale: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    hysteresis: int = 1
    dynamic: bool = True

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(
                f"LossScaleOptimizer: invalid `{name}`={getattr(self, name)!r}: {why}."
            )

        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(name, "expected a number")
            if not math.isfinite(value):
                bad(name, "must be finite")
        for name in ("growth_interval", "hysteresis"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                bad(name, "expected a positive integer")
            if value <= 0:
                bad(name, "must be a positive integer")
        if not isinstance(self.dynamic, bool):
            bad("dynamic", "expected True or False")
        if self.growth_factor <= 1:
            bad("growth_factor", "must be > 1")
        if not 0 < self.backoff_factor < 1:
            bad("backoff_factor", "must lie in (0, 1)")
        if self.min_scale <= 0:
            bad("min_scale", "must be > 0")
        if self.min_scale > self.max_scale:
            bad("min_scale", f"must be <= max_scale={self.max_scale!r}")
        if self.max_scale > 3.4e38:
            bad("max_scale", "must be representable in float32")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            bad(
                "initial_scale",
                f"must lie in [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]",
            )


class LossScaleState(NamedTuple):
    """Everything the rule carries from one step to the next.

    Attributes:
        scale: float32 scalar, the current loss scale.
        good_steps: int32 scalar, consecutive finite steps since the last change.
        hysteresis_left: int32 scalar, overflows still tolerated before a backoff.
        skipped_steps: int32 scalar, total steps skipped for non-finite gradients.
        last_overflow_step: int32 scalar, index of the last skipped step (-1: none).
        nonfinite_mask: int32 vector, 1 for each variable whose gradient was non-finite
            in the last overflow.
    """

    scale: Any
    good_steps: Any
    hysteresis_left: Any
    skipped_steps: Any
    last_overflow_step: Any
    nonfinite_mask: Any


def update_loss_scale(
    state: LossScaleState,
    per_variable_finite: Any,
    step: Any,
    config: LossScaleConfig,
) -> LossScaleState:
    """The loss-scaling rule: returns the state after one step.

    On a non-finite step the hysteresis counter drops; once it is exhausted the scale
    is multiplied by `backoff_factor` (floored at `min_scale`). Until the first finite
    step (every step so far skipped: the starting scale has never held), the k-th backoff
    multiplies by `backoff_factor ** k` instead (2^15 falls to 2^14, 2^12, 2^9, 2^5,
    2^0: 5 skipped steps instead of 15), so a loss that needs a small scale loses few
    steps of a short run; from the first finite step on, each backoff is one factor.
    After `growth_interval`
    consecutive finite steps the scale is multiplied by `growth_factor` (capped at
    `max_scale`) and the hysteresis is restored. With `config.dynamic=False` the scale
    never changes. The scale therefore stays finite and within `[min_scale, max_scale]`.

    Every field may carry leading batch dimensions (independent scalers updated at
    once); `per_variable_finite` then has shape `batch + (num_variables,)`.

    Args:
        state: the `LossScaleState` before the step.
        per_variable_finite: bool vector, one entry per gradient (True: all finite).
        step: int32 scalar, index of this step (applied plus skipped steps before it).
        config: the `LossScaleConfig`.

    Returns:
        The new `LossScaleState`.

    Example:

    >>> cfg = LossScaleConfig(initial_scale=8.0)
    >>> s = initial_loss_scale_state(cfg, num_variables=1)
    >>> s = update_loss_scale(s, ops.array([False]), 0, cfg)
    >>> float(s.scale)
    4.0
    """
    per_variable_finite = ops.convert_to_tensor(per_variable_finite, dtype="bool")
    finite = ops.all(per_variable_finite, axis=-1)
    one = ops.ones((), "int32")
    zero = ops.zeros((), "int32")
    scale = ops.cast(state.scale, "float32")

    good = ops.where(finite, state.good_steps + one, zero)
    hyst = ops.where(finite, state.hysteresis_left, ops.maximum(state.hysteresis_left - one, zero))
    if config.dynamic:
        grow = ops.logical_and(finite, good >= config.growth_interval)
        back = ops.logical_and(ops.logical_not(finite), hyst <= 0)
        grown = ops.minimum(scale * config.growth_factor, config.max_scale)
        shrunk = ops.maximum(scale * _backoff(state, step, config), config.min_scale)
        scale = ops.where(grow, grown, ops.where(back, shrunk, scale))
        good = ops.where(grow, zero, good)
        hyst = ops.where(grow, ops.full((), config.hysteresis, "int32"), hyst)
    mask = ops.where(
        ops.expand_dims(finite, -1),
        ops.cast(state.nonfinite_mask, "int32"),
        ops.cast(ops.logical_not(per_variable_finite), "int32"),
    )
    return LossScaleState(
        scale=ops.cast(scale, "float32"),
        good_steps=ops.cast(good, "int32"),
        hysteresis_left=ops.cast(hyst, "int32"),
        skipped_steps=ops.cast(state.skipped_steps + ops.where(finite, zero, one), "int32"),
        last_overflow_step=ops.cast(
            ops.where(finite, state.last_overflow_step, ops.cast(step, "int32")), "int32"
        ),
        nonfinite_mask=mask,
    )


def _backoff(state: LossScaleState, step: Any, config: LossScaleConfig):
    """This backoff's factor: `backoff_factor`, or `backoff_factor ** k` for the k-th
    backoff before the first finite step (read off the state: every step up to this one
    was skipped, `skipped_steps == step`; no state of its own to save). The powers are a
    table made on the host (`backoff_factor ** k` in float64, rounded once): a backend's
    float32 `pow` can differ from another's in the last bit (TensorFlow's 0.9 ** 7)."""
    skipped = ops.cast(state.skipped_steps, "int32")
    never_held = ops.equal(skipped, ops.cast(step, "int32"))
    k = ops.minimum(ops.maximum(skipped - (config.hysteresis - 1), 0) + 1, 32)
    powers = np.array([config.backoff_factor**n for n in range(33)], "float32")
    fast = ops.take(ops.convert_to_tensor(powers), k)
    return ops.where(never_held, fast, ops.full((), config.backoff_factor, "float32"))


def initial_loss_scale_state(config: LossScaleConfig, num_variables: int) -> LossScaleState:
    """The state before the first step (numpy values)."""

    return LossScaleState(
        scale=np.float32(config.initial_scale),
        good_steps=np.int32(0),
        hysteresis_left=np.int32(config.hysteresis),
        skipped_steps=np.int32(0),
        last_overflow_step=np.int32(-1),
        nonfinite_mask=np.zeros((num_variables,), "int32"),
    )
