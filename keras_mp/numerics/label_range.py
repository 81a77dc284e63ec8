"""Class-index labels outside `[0, classes)`: a clear error where it can be raised, NaN
where it cannot.

A sparse cross-entropy gathers each position's logit at its label. A label outside the
class range has no logit: TensorFlow's kernels raise an error that names no loss, XLA
clamps the gather (so the loss is finite and silently wrong, or NaN, by backend), JAX
reads a fill value. `kmp.losses.SparseCategoricalCrossentropy` checks the labels itself:

* where the labels are known (eager calls, JAX without `jit`), it raises a `ValueError`
  naming the bad values, the class range and `ignore_class`;
* in a TensorFlow graph without XLA, it adds an assertion that raises the same message
  when the step runs (`InvalidArgumentError`);
* under XLA (TensorFlow `jit_compile=True`, JAX), where no error can be raised from inside
  the compiled step, the position's loss and its gradient are NaN: the step is skipped
  and counted by a keras_mp scaler, the logged loss is NaN, and
  `kmp.callbacks.NonFiniteGuard` stops the run, naming the labels when its
  `diagnose_data` holds them.

Positions whose label is `ignore_class`, or that the predictions' Keras mask leaves out,
are never reported.

Example:

```python
from keras_mp.numerics.label_range import bad_label_message

bad_label_message("SparseCategoricalCrossentropy", classes=4, values=[7])
```
"""

from __future__ import annotations

import keras
import numpy as np
from keras import ops

__all__ = ["bad_label_message", "check_labels", "out_of_range", "poison"]


def bad_label_message(loss: str, classes: int, values=None, ignore_class: int | None = None) -> str:
    """The error text for labels outside `[0, classes)`.

    Args:
        loss: The loss class name.
        classes: Size of the predictions' class axis.
        values: Optional offending label values (the first few are shown).
        ignore_class: The loss's `ignore_class`, if any.

    Returns:
        One paragraph naming the range, the values and the fixes.
    """
    shown = ""
    if values is not None:
        uniq = sorted({int(v) for v in np.ravel(values)})
        shown = f"; got {', '.join(map(str, uniq[:8]))}{' ...' if len(uniq) > 8 else ''}"
    ignored = (
        f" (positions labelled ignore_class={ignore_class} are left out of the check)"
        if ignore_class is not None
        else ""
    )
    return (
        f"kmp.losses.{loss}: the labels must be class indices in [0, {classes}) (the "
        f"predictions have {classes} classes){shown}{ignored}. Check how the labels are "
        "encoded (1-based ids, or more classes than the output layer has), or pass "
        "`ignore_class=` for a padding label that should get no loss (e.g. ignore_class=-1)."
    )


def out_of_range(labels, classes: int, ignore_class: int | None = None):
    """Boolean tensor: where an int label is outside `[0, classes)` and not `ignore_class`."""
    bad = ops.logical_or(ops.less(labels, 0), ops.greater_equal(labels, classes))
    if ignore_class is not None:
        bad = ops.logical_and(bad, ops.not_equal(labels, ignore_class))
    return bad


def _concrete(x) -> np.ndarray | None:
    """`x`'s values when they are known now (eager), else None (a traced tensor)."""
    if isinstance(x, np.ndarray):
        return x
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return None if isinstance(x, jax.core.Tracer) else np.asarray(x)
    if backend == "tensorflow":
        import tensorflow as tf

        return x.numpy() if tf.executing_eagerly() and hasattr(x, "numpy") else None
    try:
        return ops.convert_to_numpy(x)
    except Exception:  # noqa: BLE001 - a traced tensor of another backend
        return None


def check_labels(labels, classes: int, loss: str, ignore_class: int | None = None):
    """Checks int32 `labels` against `[0, classes)` as the module docstring says.

    Args:
        labels: int32 labels (masked-out positions already replaced by a valid label).
        classes: Size of the class axis.
        loss: The loss class name, for the message.
        ignore_class: Label exempt from the check.

    Returns:
        `(labels, bad)`: the labels (with the assertion attached on TensorFlow graphs) and,
        where the check must be made by the computation (XLA), the boolean tensor of bad
        positions to `poison`; else None.

    Raises:
        ValueError: when the labels are known now and some are out of range.
    """
    values = _concrete(labels)
    if values is not None:
        bad = (values < 0) | (values >= classes)
        if ignore_class is not None:
            bad &= values != ignore_class
        if bad.any():
            raise ValueError(bad_label_message(loss, classes, values[bad], ignore_class))
        return labels, None
    bad = out_of_range(labels, classes, ignore_class)
    if keras.backend.backend() == "tensorflow":
        from keras_mp.tf.losses import assert_no_bad_labels, compiling_with_xla

        if not compiling_with_xla():
            message = bad_label_message(loss, classes, ignore_class=ignore_class)
            return assert_no_bad_labels(labels, bad, message), None
    return labels, bad


def poison(losses, bad, anchor):
    """NaN loss and NaN gradient (through `anchor`, a float tensor of `losses`' shape that
    depends on the predictions) at the `bad` positions; nothing changes elsewhere."""
    nan = ops.where(bad, float("nan"), 0.0)
    return losses + nan * ops.cast(anchor, losses.dtype)
