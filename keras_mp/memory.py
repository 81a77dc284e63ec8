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
import numpy as np

__all__ = ["StateBytes", "state_bytes"]


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
    """

    parameters: int
    weights: int
    compensation: int
    optimizer: int
    scaler: int

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
        return (
            f"{self.per_parameter:.2f} bytes/parameter of training state "
            f"({self.total * mib:.2f} MiB for {self.parameters:,} parameters: weights "
            f"{self.weights * mib:.2f}, compensation {self.compensation * mib:.2f}, "
            f"optimizer {self.optimizer * mib:.2f}, scaler {self.scaler * mib:.4f} MiB)"
        )


def _nbytes(variable) -> int:
    dtype = keras.backend.standardize_dtype(variable.dtype)
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    return math.prod(variable.shape) * itemsize


def state_bytes(
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = None,
    build: bool = True,
) -> StateBytes:
    """The persistent training state of `model` with `optimizer`, in bytes.

    Exact, from the variables' shapes and dtypes. An optimizer that is not built yet is
    built on the model's trainable variables (as the first training step would), unless
    `build=False`, which counts the weights alone.

    Args:
        model: A built Keras model.
        optimizer: Default: `model.optimizer` (none: the weights alone).
        build: Whether to build an optimizer that is not built yet.

    Returns:
        A `StateBytes`; `print` it, or read `per_parameter`.

    Example:

    ```python
    model = kmp.convert(model, "lean_bfloat16")
    model.compile(optimizer="adamw", loss="mse")
    kmp.state_bytes(model).per_parameter      # about 5 (mixed_bfloat16 with AdamW: 12)
    ```
    """
    from keras_mp.lean import LeanOptimizer

    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(
            f"state_bytes() takes a built keras.Model. Received: {model!r}"
        )
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    parameters = sum(math.prod(v.shape) for v in model.trainable_variables)
    weights = sum(_nbytes(v) for v in model.variables)
    compensation = opt_bytes = scaler = 0
    if optimizer is not None and not optimizer.built and not build:
        optimizer = None
    if optimizer is not None:
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        inner = getattr(optimizer, "inner_optimizer", None)
        own = optimizer.variables
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and inner is not None:
            inner_ids = {id(v) for v in inner.variables}
            scaler = sum(_nbytes(v) for v in own if id(v) not in inner_ids)
            own = inner.variables
            optimizer = inner
        for v in own:
            if isinstance(optimizer, LeanOptimizer) and v.name.endswith("_compensation"):
                compensation += _nbytes(v)
            else:
                opt_bytes += _nbytes(v)
    return StateBytes(parameters, weights, compensation, opt_bytes, scaler)
