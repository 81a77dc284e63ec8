"""Cross-entropy losses that always compute in float32.

Keras' losses compute in `keras.config.floatx()` or in the `dtype` they are given; a loss
built with `dtype="float16"` (or a `"mixed_float16"` policy, or with `floatx` set to
`"float16"`) takes its log-softmax, log-sigmoid and mean in float16, which loses the
small probabilities and rounds a mean of many terms. The losses here subclass Keras' own
and pin the computation to float32 whatever the dtype of `y_pred`: predictions are cast
to float32 first, and the loss value is float32. On float32 inputs they are numerically
the Keras losses.

`SparseCategoricalCrossentropy(from_logits=True)` (the language-model loss) is fused: its
forward pass keeps only the logits it was given (in their own dtype, e.g. bfloat16) and one
log-sum-exp per row, and its backward pass writes the gradient `softmax - one_hot` straight
in the logits' dtype. Keras' version up-casts the logits to a float32 copy and keeps float32
softmax-sized intermediates for the backward pass: about twice the temporaries for a large
vocabulary where the compiler does not fuse the up-cast away (measured in
benchmarks/BENCHMARKS.md). On TensorFlow the same loss runs chunk by chunk on oneDNN's
softmax (`keras_mp.tf.losses`), faster than TensorFlow's native kernel.

Example:

```python
import keras_mp as kmp

model.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
```
"""

from __future__ import annotations

import inspect

import keras
from keras import ops

from keras_mp.keras_glue.keras_internals import (
    get_keras_mask,
    reduce_weighted_values,
    set_keras_mask,
)
from keras_mp.numerics.label_range import (
    check_labels,
    check_sparse_shapes,
    check_unit_labels,
    known_shape,
    poison,
    unmasked_labels,
)

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "SparseCategoricalCrossentropy",
    "sparse_categorical_crossentropy_from_logits",
]

_FLOAT32 = "float32"


def _check_dtype(cls_name: str, dtype) -> None:
    """Accepts `dtype` only when it means float32 (kept for Keras-compatible configs)."""
    if dtype is None:
        return
    compute = keras.dtype_policies.get(dtype).compute_dtype
    if compute != _FLOAT32:
        raise ValueError(
            f"keras_mp.losses.{cls_name} always computes in float32; received "
            f"dtype={dtype!r}. Valid choices: None or 'float32'. Use keras.losses."
            f"{cls_name} for a loss computed in {compute}."
        )


def sparse_categorical_crossentropy_from_logits(labels, logits, ignore_class: int | None = None):
    """Per-position cross-entropy from logits over the last axis, fused and in float32.

    The loss is `logsumexp(z) - z[label]` computed in float32 whatever the dtype of the
    logits `z`. The gradient is defined directly as `(softmax(z) - one_hot(label)) * upstream`,
    computed in float32 and returned in the logits' dtype; the only tensors kept from the
    forward pass are the logits themselves and one float32 log-sum-exp per position, so no
    float32 copy of the logits and no softmax-sized float32 intermediate outlives the
    forward pass.

    Args:
        labels: Integer class ids, shape `logits.shape[:-1]` (float ids are accepted).
        logits: Floating logits, classes on the last axis, any float dtype.
        ignore_class: Optional label whose positions get zero loss and zero gradient.

    Returns:
        float32 per-position losses of shape `logits.shape[:-1]`; with `ignore_class`, the
        result carries a Keras mask of the valid positions.

    Raises:
        ValueError: a label outside `[0, classes)` (other than `ignore_class`) where the
            labels are known (eager); in a TensorFlow graph the step fails with the same
            message, and under XLA (and JAX's `jit`) the position's loss and gradient are
            NaN instead (`keras_mp.label_range`).

    Example:

    ```python
    loss = kmp.losses.sparse_categorical_crossentropy_from_logits(labels, logits_bf16)
    ```
    """
    labels = ops.cast(labels, "int32")
    bad = None
    if logits.shape[-1] is not None:
        labels, bad = check_labels(
            labels, logits.shape[-1], "SparseCategoricalCrossentropy", ignore_class
        )
    valid = None
    if ignore_class is not None:
        valid = ops.not_equal(labels, ignore_class)
        labels = ops.where(valid, labels, 0)
    tf_losses = _tf_losses()
    if bad is None and tf_losses is not None and not tf_losses.compiling_with_xla():
        losses = tf_losses.sparse_xent_from_logits(labels, logits, valid)
    else:
        losses = _fused_xla(labels, logits, valid, bad)
    if valid is not None:
        set_keras_mask(losses, mask=valid)
    return losses


def _tf_losses():
    """`keras_mp.tf.losses` on the TensorFlow backend, else None."""
    if keras.backend.backend() != "tensorflow":
        return None
    from keras_mp.tf import losses as tf_losses

    return tf_losses


def _fused_xla(labels, logits, valid, bad=None):
    """The fused loss in `keras.ops` (compiled whole by XLA on JAX; also the reference).
    Positions where `bad` (labels out of range) is True get a NaN loss and NaN gradient."""
    classes = logits.shape[-1]
    target = ops.expand_dims(labels, -1)

    @ops.custom_gradient
    def fused(z):
        # The max and the picked logit are exact in z's own dtype; only the exp-sum reads a
        # float32 view, so no float32 copy of z needs to be materialised.
        top = ops.cast(ops.stop_gradient(ops.max(z, axis=-1, keepdims=True)), _FLOAT32)
        lse = ops.log(ops.sum(ops.exp(ops.cast(z, _FLOAT32) - top), axis=-1, keepdims=True))
        lse = lse + top
        picked = ops.cast(ops.take_along_axis(z, target, axis=-1), _FLOAT32)
        losses = ops.squeeze(lse - picked, -1)
        if valid is not None:
            losses = ops.where(valid, losses, 0.0)
        if bad is not None:  # XLA clamps the gather: made loud here
            losses = ops.where(bad, float("nan"), losses)

        def grad(*args, upstream=None):
            if upstream is None:
                (upstream,) = args
            if valid is not None:
                upstream = ops.where(valid, upstream, 0.0)
            if bad is not None:
                upstream = ops.where(bad, float("nan"), upstream)
            probs = ops.exp(ops.cast(z, _FLOAT32) - lse)
            hot = ops.equal(ops.arange(classes, dtype="int32"), target)
            diff = probs - ops.cast(hot, _FLOAT32)
            return ops.cast(diff * ops.expand_dims(ops.cast(upstream, _FLOAT32), -1), z.dtype)

        return losses, grad

    return fused(logits)


@keras.saving.register_keras_serializable(package="keras_mp")
class SparseCategoricalCrossentropy(keras.losses.SparseCategoricalCrossentropy):
    """`keras.losses.SparseCategoricalCrossentropy` computed in float32.

    With `from_logits=True` and the class axis last, the loss is fused
    (`sparse_categorical_crossentropy_from_logits`): the logits are not copied to float32 and
    the gradient comes back in their own dtype, so a bfloat16 logits head costs no float32
    logits-sized memory. Otherwise it is Keras' computation on float32 inputs.

    Args:
        from_logits: Whether `y_pred` holds logits (recommended) or probabilities.
        ignore_class: Optional integer label whose entries get zero loss (e.g. padding).
        reduction: `"sum_over_batch_size"` (default), `"sum"`, `"mean"`,
            `"mean_with_sample_weight"`, `"none"` or `None`, as in Keras.
        axis: The class axis. Defaults to `-1`.
        label_smoothing: Keras 3.16's label smoothing (Keras' unfused computation; 0 keeps
            the fused path). Older Keras has none: a non-zero value raises there.
        name: Name of the loss.
        dtype: Only `None` or `"float32"` (the loss always computes in float32).

    Labels of the predictions' shape (one-hot) raise a `ValueError` naming
    `kmp.losses.CategoricalCrossentropy`, as Keras' own loss refuses them. A label outside
    `[0, classes)` (other than `ignore_class`, or at a position the predictions' mask leaves
    out) raises a `ValueError` naming the values and `ignore_class` where it can (eager
    calls; in a TensorFlow graph without XLA the step fails with the same message), and
    makes that position's loss and gradient NaN under XLA and on JAX, where nothing can be
    raised from the compiled step: the step is skipped and counted by keras_mp's scalers,
    and `kmp.callbacks.NonFiniteGuard` stops the run naming the labels. (Keras' own loss
    gives a finite, wrong loss on JAX there.)

    Returns:
        Calling the loss returns a float32 scalar (or per-sample float32 values with
        `reduction=None`).

    Example:

    ```python
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss([1, 2], logits_in_float16)   # float32 value
    ```
    """

    def __init__(
        self,
        from_logits: bool = False,
        ignore_class: int | None = None,
        reduction: str | None = "sum_over_batch_size",
        axis: int = -1,
        label_smoothing: float = 0.0,
        name: str = "sparse_categorical_crossentropy",
        dtype=None,
    ):
        _check_dtype("SparseCategoricalCrossentropy", dtype)
        smoothing = {}
        if label_smoothing:  # Keras 3.16 added it; older ones take no such argument
            if "label_smoothing" not in inspect.signature(super().__init__).parameters:
                raise ValueError(
                    "SparseCategoricalCrossentropy: `label_smoothing` needs Keras 3.16 or "
                    f"later (this is Keras {keras.__version__}); use "
                    "`kmp.losses.CategoricalCrossentropy` with one-hot labels."
                )
            smoothing["label_smoothing"] = label_smoothing
        super().__init__(
            from_logits=from_logits,
            ignore_class=ignore_class,
            reduction=reduction,
            axis=axis,
            name=name,
            dtype=_FLOAT32,
            **smoothing,
        )
        # Keras 3.16 keeps these only in the wrapped function's arguments: kept here for
        # every version (the fused path reads them).
        self.from_logits = from_logits
        self.ignore_class = ignore_class
        self.axis = axis
        self.label_smoothing = label_smoothing

    def __call__(self, y_true, y_pred, sample_weight=None):
        rank = len(getattr(y_pred, "shape", ()))
        fused = (
            self.from_logits
            and not self.label_smoothing
            and rank >= 1
            and self.axis in (-1, rank - 1)
        )
        if rank >= 1 and self.axis in (-1, rank - 1):
            target = known_shape(y_true)
            if target is not None:
                if len(target) == rank and target[-1] == 1:
                    target = target[:-1]
                check_sparse_shapes(target, tuple(y_pred.shape))
        in_mask = get_keras_mask(y_pred)
        if not fused:
            y_true = unmasked_labels(y_true, in_mask, rank)
            return super().__call__(y_true, y_pred, sample_weight=sample_weight)
        # Keras' Loss.__call__ without its float32 copy of y_pred (the fused loss up-casts
        # inside, and keeps the logits in their own dtype for the backward pass).
        with keras.name_scope(self.name):
            y_pred = ops.convert_to_tensor(y_pred)
            if not keras.backend.is_float_dtype(y_pred.dtype):
                y_pred = ops.cast(y_pred, _FLOAT32)
            y_true = unmasked_labels(y_true, in_mask, rank)
            losses = sparse_categorical_crossentropy_from_logits(
                y_true, y_pred, ignore_class=self.ignore_class
            )
            out_mask = get_keras_mask(losses)
            if in_mask is not None and out_mask is not None:
                mask = in_mask & out_mask
            else:
                mask = in_mask if in_mask is not None else out_mask
            return reduce_weighted_values(
                losses,
                sample_weight=sample_weight,
                mask=mask,
                reduction=self.reduction,
                dtype=self.dtype,
            )

    def call(self, y_true, y_pred):
        """Keras' per-position loss (the unfused path), with the label range checked."""
        rank = len(y_pred.shape)
        axis = self.axis % rank if rank else self.axis
        classes = y_pred.shape[axis] if rank else None
        bad = None
        if classes is not None and len(y_true.shape) in (rank - 1, rank):
            labels = ops.cast(y_true, "int32")
            if len(labels.shape) == rank:
                labels = ops.squeeze(labels, axis)
            labels, bad = check_labels(
                labels, classes, "SparseCategoricalCrossentropy", self.ignore_class
            )
            if bad is None:
                y_true = labels  # carries the TensorFlow assertion
        losses = super().call(y_true, y_pred)
        if bad is not None:  # XLA clamps the gather, JAX reads a fill value: made loud
            losses = poison(losses, ops.reshape(bad, ops.shape(losses)), ops.sum(y_pred, axis))
        return losses

    def get_config(self) -> dict:
        config = super().get_config()
        config["axis"] = self.axis  # Keras 3.15 leaves `axis` out of this config.
        config["from_logits"] = self.from_logits
        config["ignore_class"] = self.ignore_class
        if self.label_smoothing:
            config["label_smoothing"] = self.label_smoothing
        else:
            config.pop("label_smoothing", None)  # loadable by a Keras without it
        return config


@keras.saving.register_keras_serializable(package="keras_mp")
class CategoricalCrossentropy(keras.losses.CategoricalCrossentropy):
    """`keras.losses.CategoricalCrossentropy` computed in float32.

    Args:
        from_logits: Whether `y_pred` holds logits (recommended) or probabilities.
        label_smoothing: Float in `[0, 1]`; smooths the one-hot targets.
        axis: The class axis. Defaults to `-1`.
        reduction: As in `keras.losses.Loss`. Defaults to `"sum_over_batch_size"`.
        name: Name of the loss.
        dtype: Only `None` or `"float32"` (the loss always computes in float32).

    Returns:
        Calling the loss returns a float32 scalar (or per-sample float32 values with
        `reduction=None`).

    Example:

    ```python
    loss = kmp.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    ```
    """

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str | None = "sum_over_batch_size",
        name: str = "categorical_crossentropy",
        dtype=None,
    ):
        _check_dtype("CategoricalCrossentropy", dtype)
        super().__init__(
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
            reduction=reduction,
            name=name,
            dtype=_FLOAT32,
        )


@keras.saving.register_keras_serializable(package="keras_mp")
class BinaryCrossentropy(keras.losses.BinaryCrossentropy):
    """`keras.losses.BinaryCrossentropy` computed in float32.

    Labels outside `[0, 1]` (e.g. -1/1 labels) raise a `ValueError` naming them where they
    are known (eager calls; a TensorFlow graph without XLA fails the step with the same
    message) and make their sample's loss and gradient NaN under XLA and on JAX (a skipped
    step under keras_mp's scalers), where Keras' loss trains on them silently.

    Args:
        from_logits: Whether `y_pred` holds logits (recommended) or probabilities.
        label_smoothing: Float in `[0, 1]`; moves targets towards 0.5.
        axis: The axis along which the mean is computed. Defaults to `-1`.
        reduction: As in `keras.losses.Loss`. Defaults to `"sum_over_batch_size"`.
        name: Name of the loss.
        dtype: Only `None` or `"float32"` (the loss always computes in float32).

    Returns:
        Calling the loss returns a float32 scalar (or per-sample float32 values with
        `reduction=None`).

    Example:

    ```python
    loss = kmp.losses.BinaryCrossentropy(from_logits=True)
    ```
    """

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        axis: int = -1,
        reduction: str | None = "sum_over_batch_size",
        name: str = "binary_crossentropy",
        dtype=None,
    ):
        _check_dtype("BinaryCrossentropy", dtype)
        super().__init__(
            from_logits=from_logits,
            label_smoothing=label_smoothing,
            axis=axis,
            reduction=reduction,
            name=name,
            dtype=_FLOAT32,
        )

    def call(self, y_true, y_pred):
        """Keras' per-sample loss, with the labels checked against `[0, 1]`."""
        return super().call(check_unit_labels(y_true, "BinaryCrossentropy"), y_pred)
