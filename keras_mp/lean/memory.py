"""What a model's training state weighs: exact bytes, read off the variables.

The persistent training state is everything that lives from one step to the next: the
model's weights, a lean optimizer's compensation buffers, the optimizer's slots (moments,
scales, EMA averages, gradient accumulators, its step counter) and a loss scaler's state.
Activations and gradients are not in it (they live within a step).
"""

from __future__ import annotations

import dataclasses
import math

import keras

from keras_mp.lean.optimizer import LeanOptimizer
from keras_mp.lean.sharding import variable_bytes

__all__ = ["StateBytes", "state_bytes", "variable_bytes"]


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes of persistent training state, by kind.

    Attributes:
        parameters: number of trainable parameters (the denominator of `per_parameter`).
        weights: bytes of the model's variables (trainable and not).
        compensation: bytes of `LeanOptimizer`'s compensation buffers.
        optimizer: bytes of the optimizer's other variables (moments and their scales,
            EMA averages, gradient accumulators, counters).
        scaler: bytes of a loss scaler's own variables.
        optimizers: how many optimizers' state is counted (0: the weights alone).
    """

    parameters: int
    weights: int
    compensation: int
    optimizer: int
    scaler: int
    optimizers: int = 1

    @property
    def total(self) -> int:
        """All persistent bytes."""
        return self.weights + self.compensation + self.optimizer + self.scaler

    @property
    def per_parameter(self) -> float:
        """`total / parameters` (0 for a model without trainable parameters)."""
        return self.total / self.parameters if self.parameters else 0.0

    def to_dict(self) -> dict:
        return {
            **dataclasses.asdict(self),
            "total": self.total,
            "per_parameter": round(self.per_parameter, 4),
        }

    def __str__(self):
        mib = 1 / 2**20
        counted = {0: " (weights only: no optimizer)", 1: ""}.get(
            self.optimizers, f" ({self.optimizers} optimizers)"
        )
        return (
            f"{self.per_parameter:.2f} bytes/parameter of training state{counted} "
            f"({self.total * mib:.2f} MiB for {self.parameters:,} parameters: weights "
            f"{self.weights * mib:.2f}, compensation {self.compensation * mib:.2f}, "
            f"optimizer {self.optimizer * mib:.2f}, scaler {self.scaler * mib:.4f} MiB)"
        )


def state_bytes(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | list | tuple | None = None,
    build: bool = True,
) -> StateBytes:
    """The persistent training state of `model` with `optimizer`, in bytes.

    Exact, from the variables' shapes and dtypes. An optimizer that is not built yet is
    built on the model's trainable variables (as the first training step would), unless
    `build=False`, which leaves it out. `optimizers` of the result says how many
    optimizers were counted (0: the weights alone, and `print` says so).

    Args:
        model: A Keras model with its variables created: a built model, or a container
            (a GAN's model holding a generator and a discriminator).
        optimizer: an optimizer, or a list of them (a GAN's two, each built on its own
            variables; each counted once, a wrapper's inner optimizer in its wrapper);
            default: `model.optimizer` (none: the weights alone).
        build: Whether to build a single optimizer that is not built yet.

    Returns:
        A `StateBytes`; `print` it, or read `per_parameter`.

    Example:

    ```python
    model = kmp.convert(model, "lean_bfloat16")
    model.compile(optimizer="adamw", loss="mse")
    kmp.state_bytes(model).per_parameter      # about 2.55 on a GPT-2 (mixed_bfloat16: 12)
    ```
    """
    if not isinstance(model, keras.Model) or not (model.built or model.variables):
        raise ValueError(
            "state_bytes() takes a keras.Model whose variables exist (a built model, or a "
            f"container of built models). Received: {model!r}"
        )
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    several = isinstance(optimizer, (list, tuple))
    optimizers = list(optimizer) if several else [] if optimizer is None else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, keras.optimizers.Optimizer):
            raise ValueError(
                f"state_bytes(): `optimizer` must be a keras optimizer or a list of them; "
                f"got {opt!r}."
            )
        if several and not opt.built:
            raise ValueError(
                f"state_bytes(): optimizer {opt.name!r} is not built; with several "
                "optimizers each must be built on its own variables first "
                "(`optimizer.build(variables)`, as its first step does)."
            )
    # Each optimizer's state once: the same one listed twice, or a wrapper and the
    # optimizer it wraps (whose state the wrapper's already holds).
    inner = {id(getattr(opt, "inner_optimizer", None)) for opt in optimizers}
    optimizers = [
        opt
        for i, opt in enumerate(optimizers)
        if id(opt) not in inner and all(opt is not o for o in optimizers[:i])
    ]
    if not build:
        optimizers = [opt for opt in optimizers if opt.built]
    parameters = sum(math.prod(v.shape) for v in model.trainable_variables)
    weights = sum(variable_bytes(v) for v in model.variables)
    totals = [0, 0, 0]  # compensation, optimizer, scaler
    for opt in optimizers:
        for i, value in enumerate(_optimizer_bytes(model, opt)):
            totals[i] += value
    return StateBytes(parameters, weights, *totals, optimizers=len(optimizers))


def _optimizer_bytes(model, optimizer) -> tuple:
    """`(compensation, optimizer, scaler)` bytes of one optimizer (built here if needed)."""

    compensation = opt_bytes = scaler = 0
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    inner = getattr(optimizer, "inner_optimizer", None)
    own = optimizer.variables
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and inner is not None:
        inner_ids = {id(v) for v in inner.variables}
        scaler = sum(variable_bytes(v) for v in own if id(v) not in inner_ids)
        own = inner.variables
        optimizer = inner
    for v in own:
        if isinstance(optimizer, LeanOptimizer) and v.name.endswith("_compensation"):
            compensation += variable_bytes(v)
        else:
            opt_bytes += variable_bytes(v)
    return compensation, opt_bytes, scaler
