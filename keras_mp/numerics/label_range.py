"""The losses' checks of labels against the predictions: shapes (`check_sparse_shapes`),
masked positions (`unmasked_labels`) and, here in the main, values outside the class range
(or outside `[0, 1]` for a binary loss): a clear error where it can be raised, NaN where it
cannot.

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

__all__ = [
    "bad_label_message",
    "check_labels",
    "check_sparse_shapes",
    "check_unit_labels",
    "known_shape",
    "out_of_range",
    "poison",
    "unmasked_labels",
]


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


def check_unit_labels(labels, loss: str):
    """Checks float `labels` of a binary cross-entropy against `[0, 1]`: a `ValueError` where
    the values are known, an assertion in a TensorFlow graph without XLA, else NaN in place
    of each bad label (so its sample's loss and gradient are NaN).

    Returns:
        The labels (with the assertion attached, or with NaN at the bad entries).
    """
    values = _concrete(labels)
    if values is not None:
        values = np.asarray(values, dtype="float64")
        bad = (values < 0) | (values > 1)
        if bad.any():
            raise ValueError(_unit_message(loss, values[bad]))
        return labels
    bad = ops.logical_or(ops.less(labels, 0), ops.greater(labels, 1))
    if keras.backend.backend() == "tensorflow":
        from keras_mp.tf.losses import assert_no_bad_labels, compiling_with_xla

        if not compiling_with_xla():
            return assert_no_bad_labels(labels, bad, _unit_message(loss))
    return ops.where(bad, float("nan"), labels)


def _unit_message(loss: str, values=None) -> str:
    shown = ""
    if values is not None:
        uniq = sorted({float(v) for v in np.ravel(values)})
        shown = f"; got {', '.join(f'{v:g}' for v in uniq[:8])}{' ...' if len(uniq) > 8 else ''}"
    return (
        f"kmp.losses.{loss}: the labels must be in [0, 1] (the probability of the positive "
        f"class){shown}. Labels in {{-1, 1}} map to it with (y + 1) / 2; for class indices of "
        "more than two classes use kmp.losses.SparseCategoricalCrossentropy."
    )


def poison(losses, bad, anchor):
    """NaN loss and NaN gradient (through `anchor`, a float tensor of `losses`' shape that
    depends on the predictions) at the `bad` positions; nothing changes elsewhere."""
    nan = ops.where(bad, float("nan"), 0.0)
    return losses + nan * ops.cast(anchor, losses.dtype)


def known_shape(x) -> tuple | None:
    """`x`'s shape as a tuple, or None where its rank is unknown (a TF graph tensor)."""
    try:
        shape = x.shape if hasattr(x, "shape") else np.shape(x)
        return tuple(shape)
    except (ValueError, TypeError):
        return None


def check_sparse_shapes(target_shape, output_shape) -> None:
    """Keras' checks of integer labels against logits, made before the fused path (whose
    own error, from inside the backend, would not name the labels)."""
    if len(target_shape) != len(output_shape) - 1:
        hint = (
            " The labels look one-hot (the same shape as the predictions): use "
            "`kmp.losses.CategoricalCrossentropy` for one-hot labels, or pass class indices."
            if tuple(target_shape) == tuple(output_shape)
            else ""
        )
        raise ValueError(
            "SparseCategoricalCrossentropy: the labels must have one dimension less than the "
            f"predictions (integer class indices); got labels of shape {tuple(target_shape)} "
            f"and predictions of shape {tuple(output_shape)}.{hint}"
        )
    for a, b in zip(target_shape, output_shape[:-1]):
        if a is not None and b is not None and a != b:
            raise ValueError(
                "SparseCategoricalCrossentropy: the labels' shape must match the predictions' "
                f"without their class axis; got labels of shape {tuple(target_shape)} and "
                f"predictions of shape {tuple(output_shape)}."
            )


def unmasked_labels(y_true, mask, rank: int):
    """`y_true` as a tensor without a trailing axis of 1, with label 0 at the positions the
    predictions' Keras `mask` leaves out (their loss is masked away: a padding label there
    is no error)."""
    y_true = ops.convert_to_tensor(y_true)
    if len(y_true.shape) == rank and y_true.shape[-1] == 1:
        y_true = ops.squeeze(y_true, -1)
    if mask is not None and len(mask.shape) == len(y_true.shape):
        y_true = ops.where(mask, y_true, ops.zeros_like(y_true))
    return y_true
