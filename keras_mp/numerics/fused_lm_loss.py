"""The fused logits loss in a language model's `fit`: `use_fused_loss(task)`.

A causal language model (keras_hub's `GPT2CausalLM`, `Llama3CausalLM`, `GemmaCausalLM`,
any functional model whose output is a `ReversibleEmbedding` called with `reverse=True`
or a bias-free linear `Dense`) ends in `logits = head(hidden)`, and `fit` takes the
cross-entropy of those logits: the whole `tokens x vocabulary` tensor is made, and in
the backward pass its softmax too. `use_fused_loss(task)` routes the training and
evaluation steps through `keras_mp.numerics.linear_cross_entropy` instead:

- in `train_step` and `test_step` the head gives back its input (the hidden states) as
  the model's output, and `compute_loss` takes the cross-entropy of `head(hidden)` chunk
  by chunk with the compiled loss' `ignore_class`, `sample_weight` (keras_hub's padding
  mask) and reduction, and the head's `logit_soft_cap` and `reverse_dtype`;
- `SparseCategoricalAccuracy` metrics (keras_hub's default) are updated from the fused
  op's argmax, in the same pass; other metrics that read the logits are refused in one
  line (compile them off, or evaluate them on `predict`'s logits);
- `predict`, `generate` and a plain call are untouched: they return logits.

The change is to this model object (its methods and its head's), not saved with it:
call `use_fused_loss` again after loading. JAX and TensorFlow.

Example:

```python
task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
task = kmp.convert(task, "lean_bfloat16")
kmp.use_fused_loss(task)
task.compile(optimizer="adamw", weighted_metrics=["sparse_categorical_accuracy"])
task.fit(x, y)      # never makes the logits whole
```
"""

from __future__ import annotations

import contextlib
import functools
import threading

import keras
from keras import ops

from keras_mp.keras_glue.keras_internals import reduce_weighted_values
from keras_mp.numerics.linear_cross_entropy import linear_cross_entropy

__all__ = ["fused_head", "use_fused_loss"]

_state = threading.local()
_MARK = "_keras_mp_fused_loss"


def _active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _fused():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def fused_head(model) -> keras.layers.Layer:
    """The layer whose output is `model`'s logits, if the fused loss can replace it.

    Args:
        model: a functional Keras model (a keras_hub causal LM task).

    Returns:
        The head layer: a `keras.layers.ReversibleEmbedding` (tied or untied) or a
        bias-free, activation-free `keras.layers.Dense`.

    Raises:
        ValueError: naming what the model's output is, where it is neither.
    """
    outputs = getattr(model, "outputs", None)
    if not outputs or len(outputs) != 1:
        raise ValueError(
            f"use_fused_loss: {model.name!r} is not a functional model with one output "
            "(the logits); the fused loss needs the layer that makes them."
        )
    history = getattr(outputs[0], "_keras_history", None)
    layer = history[0] if history else None
    if isinstance(layer, keras.layers.ReversibleEmbedding):
        if getattr(layer, "quantization_mode", None):
            raise ValueError(
                f"use_fused_loss: the head {layer.name!r} is quantized "
                f"({layer.quantization_mode}); the fused loss reads a float kernel."
            )
        return layer
    if isinstance(layer, keras.layers.Dense):
        if layer.use_bias or layer.activation not in (None, keras.activations.linear):
            raise ValueError(
                f"use_fused_loss: the head {layer.name!r} has a bias or an activation; the "
                "fused loss covers `hidden @ kernel` (a bias-free, linear Dense)."
            )
        return layer
    name = type(layer).__name__ if layer is not None else "unknown"
    raise ValueError(
        f"use_fused_loss: {model.name!r}'s output comes from a {name}, not a "
        "ReversibleEmbedding (reverse=True) or a bias-free Dense: nothing to fuse."
    )


def _kernel(head):
    """`(kernel, transposed)` of the head's projection."""
    if isinstance(head, keras.layers.Dense):
        return head.kernel, False
    if head.tie_weights:
        return head.embeddings, True
    return head.reverse_embeddings, False


def _loss_settings(model) -> tuple:
    """`(ignore_class, reduction)` of the compiled loss, refused unless it is a sparse
    categorical cross-entropy from logits."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, (list, tuple)) and len(loss) == 1:
        loss = loss[0]
    if isinstance(loss, dict) and len(loss) == 1:
        loss = next(iter(loss.values()))
    ok = isinstance(loss, keras.losses.SparseCategoricalCrossentropy) and getattr(
        loss, "from_logits", loss.get_config().get("from_logits")
    )
    if not ok or getattr(loss, "label_smoothing", 0.0):
        raise ValueError(
            f"use_fused_loss: {model.name!r} is compiled with loss={loss!r}; the fused loss "
            "replaces SparseCategoricalCrossentropy(from_logits=True) (without label "
            "smoothing). Compile with that loss (keras_hub's default), or do not fuse."
        )
    config = loss.get_config()
    return config.get("ignore_class"), config.get("reduction", "sum_over_batch_size")


def _accuracy_metrics(model, y, y_pred) -> list:
    """The compiled metrics (built on the hidden states if they were not), all of which
    must be `SparseCategoricalAccuracy`: they are the ones the fused pass can update."""
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None:
        return []
    if not compiled.built:
        compiled.build(y, y_pred)
    found = compiled.metrics
    other = [m.name for m in found if not isinstance(m, keras.metrics.SparseCategoricalAccuracy)]
    if other:
        raise ValueError(
            f"use_fused_loss: the metrics {other} read the logits, which the fused training "
            "step never makes; compile without them (SparseCategoricalAccuracy is kept), "
            "or compute them on `model.predict`'s logits."
        )
    return found


def _fused_loss(model, head, y, hidden, sample_weight):
    ignore_class, reduction = _loss_settings(model)
    kernel, transposed = _kernel(head)
    labels = ops.convert_to_tensor(y)
    if len(labels.shape) == len(hidden.shape):  # (batch, tokens, 1)
        labels = ops.squeeze(labels, -1)
    labels = ops.cast(labels, "int32")
    valid = None if ignore_class is None else ops.not_equal(labels, ignore_class)
    dtype = getattr(head, "reverse_dtype", None)
    losses, predicted = linear_cross_entropy(
        hidden,
        ops.convert_to_tensor(kernel),
        labels,
        transposed=transposed,
        valid=valid,
        logit_soft_cap=getattr(head, "logit_soft_cap", None),
        compute_dtype=dtype,
    )
    total = reduce_weighted_values(
        losses, sample_weight=sample_weight, mask=valid, reduction=reduction, dtype="float32"
    )
    metrics = _accuracy_metrics(model, y, hidden)
    if metrics:
        # as Keras' accuracy counts them: every position, by its sample weight (the loss'
        # ignore_class is the loss'; Keras' metric does not read it)
        matches = ops.cast(ops.equal(predicted, labels), "float32")
        weight = None if sample_weight is None else ops.cast(sample_weight, "float32")
        for metric in metrics:
            keras.metrics.Mean.update_state(metric, matches, sample_weight=weight)
    return total


def use_fused_loss(model):
    """Trains (and evaluates) `model` with a cross-entropy that never holds its logits.

    `fit` and `evaluate` take the loss chunk by chunk over the vocabulary from the hidden
    states and the head's kernel (`keras_mp.numerics.linear_cross_entropy`: float32
    log-sum-exp, a custom gradient that recomputes each chunk's logits), with the compiled
    `SparseCategoricalCrossentropy(from_logits=True)`'s `ignore_class` and reduction and
    the batch's `sample_weight`. `predict`, `generate` and `model(x)` still return logits.

    Args:
        model: a functional model whose one output is the logits of a
            `ReversibleEmbedding` (`reverse=True`; keras_hub's causal LMs) or of a
            bias-free `Dense`, compiled (or to be compiled) with
            `SparseCategoricalCrossentropy(from_logits=True)`.

    Returns:
        `model`, changed in place.

    Raises:
        ValueError: the model's output is not such a head; at the first step, a loss or a
            metric the fused step cannot compute (named).

    Example:

    ```python
    kmp.use_fused_loss(causal_lm)
    causal_lm.fit(x, y)
    ```
    """
    if getattr(model, _MARK, False):
        return model
    if keras.backend.backend() not in ("jax", "tensorflow"):
        raise NotImplementedError(
            f"use_fused_loss: the {keras.backend.backend()} backend is not supported (JAX "
            "and TensorFlow are)."
        )
    head = fused_head(model)
    head_call = head.call

    @functools.wraps(head_call)
    def call(inputs, *args, **kwargs):
        reverse = kwargs.get("reverse", args[0] if args else False)
        if _active() and (reverse or isinstance(head, keras.layers.Dense)):
            return inputs  # the hidden states: the loss applies the head itself
        return head_call(inputs, *args, **kwargs)

    head.call = call
    compute_loss = model.compute_loss
    compute_metrics = model.compute_metrics

    def fused_compute_loss(x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if not _active():
            return compute_loss(x, y, y_pred, sample_weight, training=training)
        total = _fused_loss(model, head, y, y_pred, sample_weight)
        for extra in model.losses:  # regularizers, add_loss: as Keras' compute_loss adds them
            total = total + ops.cast(ops.sum(extra), total.dtype)
        return total

    def fused_compute_metrics(x, y, y_pred, sample_weight=None):
        if not _active():
            return compute_metrics(x, y, y_pred, sample_weight)
        return model.get_metrics_result()  # accuracy was updated with the loss

    def stepped(step):
        @functools.wraps(step)
        def run(*args, **kwargs):
            with _fused():
                return step(*args, **kwargs)

        return run

    model.compute_loss = fused_compute_loss
    model.compute_metrics = fused_compute_metrics
    model.train_step = stepped(model.train_step)
    model.test_step = stepped(model.test_step)
    setattr(model, _MARK, True)
    for name in ("train_function", "test_function"):  # a compiled step is traced anew
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
    return model
