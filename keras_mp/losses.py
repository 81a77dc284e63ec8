"""Cross-entropy losses that always compute in float32.

Keras' losses compute in `keras.config.floatx()` or in the `dtype` they are given; a loss
built with `dtype="float16"` (or a `"mixed_float16"` policy, or with `floatx` set to
`"float16"`) takes its log-softmax, log-sigmoid and mean in float16, which loses the
small probabilities and rounds a mean of many terms. The losses here subclass Keras' own
and pin the computation to float32 whatever the dtype of `y_pred`: predictions are cast
to float32 first, and the loss value is float32. On float32 inputs they are numerically
the Keras losses.

Example:

```python
import keras_mp as kmp

model.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
```
"""

from __future__ import annotations

import keras

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "SparseCategoricalCrossentropy",
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


@keras.saving.register_keras_serializable(package="keras_mp")
class SparseCategoricalCrossentropy(keras.losses.SparseCategoricalCrossentropy):
    """`keras.losses.SparseCategoricalCrossentropy` computed in float32.

    Args:
        from_logits: Whether `y_pred` holds logits (recommended) or probabilities.
        ignore_class: Optional integer label whose entries get zero loss (e.g. padding).
        reduction: `"sum_over_batch_size"` (default), `"sum"`, `"mean"`,
            `"mean_with_sample_weight"`, `"none"` or `None`, as in Keras.
        axis: The class axis. Defaults to `-1`.
        name: Name of the loss.
        dtype: Only `None` or `"float32"` (the loss always computes in float32).

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
        name: str = "sparse_categorical_crossentropy",
        dtype=None,
    ):
        _check_dtype("SparseCategoricalCrossentropy", dtype)
        super().__init__(
            from_logits=from_logits,
            ignore_class=ignore_class,
            reduction=reduction,
            axis=axis,
            name=name,
            dtype=_FLOAT32,
        )
        self.axis = axis

    def get_config(self) -> dict:
        config = super().get_config()
        config["axis"] = self.axis  # Keras 3.15 leaves `axis` out of this config.
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
