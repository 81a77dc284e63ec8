"""The fused sparse cross-entropy from logits, written for TensorFlow.

TensorFlow's native `SparseSoftmaxCrossEntropyWithLogits` CPU kernel (what Keras' loss runs)
is slow: several times slower than oneDNN's softmax over the same logits, a large share of a
bfloat16 language-model step. It also computes the float32 gradient in the forward pass and
keeps it until the backward pass. This version:

- up-casts and takes oneDNN's float32 softmax over row chunks of about `chunk_elements`
  values (a `tf.while_loop` running two chunks at a time), so the float32 temporaries are
  those of two chunks, not of the whole logits tensor (float32 logits need no up-cast and
  go through in one piece: chunks of the gradient would be assembled into a second buffer);
- keeps only the logits (in their own dtype) and two float32 numbers per row (the
  log-sum-exp and the label's logit) for the backward pass;
- recomputes the softmax chunk by chunk in the backward pass and writes the gradient
  `(softmax - one_hot) * upstream` straight in the logits' dtype; the label entries, where
  `softmax - 1` cancels, are computed from the two saved numbers in float32.

The log-sum-exp needs no second pass over the logits: at a row's maximum `m` the softmax is
`exp(m - lse)`, never below `1 / classes`, so `lse = m - log(max(softmax))` exactly (to
float32 rounding), also where the label's probability underflows.

The result: faster bfloat16 train steps than with Keras' loss, and a lower tensor peak
(benchmarks/BENCHMARKS.md). Under `jit_compile=True` the public loss takes the `keras.ops`
formulation instead (`compiling_with_xla`).

Example:

```python
from keras_mp.tf.losses import sparse_xent_from_logits

per_token = sparse_xent_from_logits(labels, logits_bf16)   # float32, labels' shape
```
"""

from __future__ import annotations

from keras_mp.tf.xla import compiling_with_xla

__all__ = ["assert_no_bad_labels", "compiling_with_xla", "sparse_xent_from_logits"]

CHUNK_ELEMENTS = 2**21  # float32 values per chunk: 8 MiB temporaries


def _chunked(fn, dtype, tail, rows, chunks, *tensors):
    """`concat([fn(*(t[i*rows:(i+1)*rows] for t in tensors)) for i in range(chunks)])`,
    two chunks at a time; every tensor has `rows * chunks` rows (XLA: static chunk shapes),
    and `fn` returns rows of shape `tail`."""
    import tensorflow as tf

    if isinstance(chunks, int) and chunks == 1:
        return tf.reshape(fn(*tensors), [-1, *tail])

    def body(i, out):
        # tf.slice with a static size: a dynamic-slice under XLA (t[a:a + rows] is not).
        parts = (
            tf.slice(t, [i * rows] + [0] * (t.shape.rank - 1), [rows] + [-1] * (t.shape.rank - 1))
            for t in tensors
        )
        return i + 1, out.write(i, fn(*parts))

    out = tf.TensorArray(dtype, size=chunks, infer_shape=False)
    # Two iterations at once: two oneDNN softmaxes in flight, faster steps for a slightly
    # higher tensor peak.
    _, out = tf.while_loop(
        lambda i, _: i < chunks, body, (tf.constant(0), out), parallel_iterations=2
    )
    return tf.reshape(out.concat(), [-1, *tail])


def assert_no_bad_labels(labels, bad, message: str):
    """`labels`, made to depend on an assertion that no entry of `bad` is True.

    The assertion (a graph op: no host sync) fails the step with `message` and the bad
    values (`InvalidArgumentError`), before the gather that cannot index them.
    """
    import tensorflow as tf

    check = tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(bad)),
        [message, "Out-of-range label values:", tf.boolean_mask(labels, bad)],
        summarize=8,
    )
    with tf.control_dependencies([check]):
        return tf.identity(labels)


def sparse_xent_from_logits(labels, logits, valid=None, chunk_elements: int = CHUNK_ELEMENTS):
    """Per-position `logsumexp(z) - z[label]` in float32 with a fused, chunked gradient.

    Args:
        labels: int32 class ids, shape `logits.shape[:-1]`, each in `[0, classes)`.
        logits: float logits (any float dtype), classes on the last axis.
        valid: Optional bool tensor of `labels`' shape; positions where it is False get zero
            loss and zero gradient.
        chunk_elements: About how many float32 values one chunk's temporaries hold.

    Returns:
        float32 losses of `labels`' shape; the gradient with respect to `logits` comes back
        in `logits.dtype`.

    Example:

    ```python
    losses = sparse_xent_from_logits(tf.constant([2]), tf.constant([[1.0, 2.0, 3.0]]))
    ```
    """
    import tensorflow as tf

    f32 = tf.float32
    logits = tf.convert_to_tensor(logits)
    classes = logits.shape[-1]
    if classes is None:
        raise ValueError(
            f"The class axis of the logits must have a known size; got {logits.shape}."
        )
    out_shape = tf.shape(labels)
    flat_labels = tf.reshape(tf.cast(labels, tf.int32), [-1])
    flat_valid = None if valid is None else tf.reshape(valid, [-1])
    rows_total = flat_labels.shape[0]  # static when known: no padding, no slicing
    if rows_total is None:
        rows_total = tf.shape(flat_labels)[0]
    if logits.dtype == f32:
        # Nothing to up-cast, so no float32 copies for chunks to bound, and chunks of the
        # gradient would be assembled into a second buffer: one piece.
        chunks, rows, padding = 1, rows_total, 0
    else:
        # As many chunks as needed for <= chunk_elements values each, then rows spread
        # evenly over them: padding (a copy of the logits) only when no split is exact.
        most_rows = max(1, chunk_elements // classes)
        chunks = (rows_total + most_rows - 1) // most_rows
        chunks = max(chunks, 1) if isinstance(chunks, int) else tf.maximum(chunks, 1)
        rows = (rows_total + chunks - 1) // chunks
        padding = chunks * rows - rows_total
    index = tf.stack([tf.range(rows_total), flat_labels], axis=1)

    # A copy only when the rows are not a whole number of chunks (or not known).
    exact = isinstance(padding, int) and padding == 0

    def pad(t):
        return t if exact else tf.pad(t, [[0, padding]] + [[0, 0]] * (t.shape.rank - 1))

    def unpad(t):
        return t if exact else t[:rows_total]

    @tf.custom_gradient
    def fused(z):
        padded = pad(z)

        def chunk_lse(zc):
            zc = tf.cast(zc, f32)  # (TF's reductions over bfloat16 are 5x slower)
            probs = tf.nn.softmax(zc)
            return tf.reduce_max(zc, -1) - tf.math.log(tf.reduce_max(probs, -1))

        lse = unpad(_chunked(chunk_lse, f32, (), rows, chunks, padded))
        picked = tf.cast(tf.gather_nd(z, index), f32)
        losses = lse - picked
        if flat_valid is not None:
            losses = tf.where(flat_valid, losses, 0.0)

        def grad(upstream):
            upstream = tf.cast(upstream, f32)
            if flat_valid is not None:
                upstream = tf.where(flat_valid, upstream, 0.0)
            # Without this, where `upstream` is a constant (a plain mean of the losses: Grappler
            # folds it), TF's executor may run this loop while the forward loop still runs
            # and hold its result until the backward pass.
            with tf.control_dependencies([upstream, lse]):
                again = tf.identity(z)

            # The label entries, where softmax - 1 cancels, from the saved float32 numbers.
            at_label = upstream * (tf.exp(picked - lse) - 1.0)

            def chunk_grad(zc, uc, yc, at_label_c):
                dz = tf.nn.softmax(tf.cast(zc, f32)) * uc[:, None]
                where = tf.stack([tf.range(tf.shape(yc)[0]), yc], axis=1)
                # Chunk-sized: a scatter into the whole gradient may copy it (TF forwards the
                # buffer only when nothing else holds it).
                return tf.cast(tf.tensor_scatter_nd_update(dz, where, at_label_c), z.dtype)

            parts = (pad(again), pad(upstream), pad(flat_labels), pad(at_label))
            return unpad(_chunked(chunk_grad, z.dtype, (classes,), rows, chunks, *parts))

        return losses, grad

    losses = fused(tf.reshape(logits, [-1, classes]))
    return tf.reshape(losses, out_shape)
