"""Which loss-scale optimizers had `scale_loss` called since their last `apply`: a step
that never scaled its loss (a float32 custom loop) must not divide its gradients."""

from __future__ import annotations

import threading

__all__ = ["NOT_SCALED_MESSAGE", "mark_scaled", "take_scaled"]

# Which optimizers had `scale_loss` called since their last `apply`, per thread (a
# MirroredStrategy traces each replica's step in its own thread). Set and read while the
# step is traced (or run eagerly), so the compiled step knows it as a constant.
_SCALED = threading.local()


def mark_scaled(optimizer) -> None:
    if not hasattr(_SCALED, "ids"):
        _SCALED.ids = set()
    _SCALED.ids.add(id(optimizer))


def take_scaled(optimizer) -> bool:
    ids = getattr(_SCALED, "ids", set())
    scaled = id(optimizer) in ids
    ids.discard(id(optimizer))
    return scaled


NOT_SCALED_MESSAGE = (
    "LossScaleOptimizer {name!r}: gradients were applied but the loss was never scaled "
    "(`optimizer.scale_loss(loss)` was not called since the last step), as in a custom "
    "train_step or training loop written for float32. They are applied as they are, not "
    "divided by the scale; non-finite steps are still skipped. Float16 gradients below "
    "6e-8 underflow to zero unscaled: scale the loss inside the tape, "
    "`loss = self.optimizer.scale_loss(loss)`, before `tape.gradient` "
    "(see docs/custom-training.md)."
)
