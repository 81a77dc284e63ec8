"""A fused linear + cross-entropy that never holds the full logits (issue 54, lever 3).

A language model's loss is `cross_entropy(hidden @ kernel, labels)`: with 2048 tokens and
Llama-3's 128,256-word vocabulary the logits alone are 0.98 GiB in bfloat16 (1.96 in
float32), and their float32 softmax in the backward pass as much again. Here the
vocabulary is cut into chunks; each chunk's logits are made, folded into a running
float32 log-sum-exp (the online softmax of flash attention) and dropped. The gradient is
custom: the backward pass makes each chunk's logits again from the saved hidden states
and kernel, turns them into `softmax - one_hot` with the saved log-sum-exp, and adds that
chunk's share to the hidden states' gradient (a float32 accumulator, tokens x hidden) and
writes the kernel's gradient for the chunk's columns. What is kept from the forward pass:
one float32 log-sum-exp a token. What is live at once: one chunk's logits
(tokens x `chunk` float32), never tokens x vocabulary.

As Liger Kernel's and Apple's Cut Cross-Entropy do on PyTorch; JAX has no such op (jax PR
35915), Keras and keras_hub none. `logit_soft_cap` (Gemma 2's `cap * tanh(z / cap)`) is
applied to each chunk, its derivative in the backward pass.

On JAX: `jax.custom_vjp` and `lax.fori_loop` over the chunks (XLA keeps one chunk's
logits live). On TensorFlow: `tf.custom_gradient` over the same chunks in Python (the
values and gradients are the same; TensorFlow's executor may run chunks side by side, so
the peak is not promised there). Other backends: refused in one line.

Example:

```python
from keras_mp.numerics.linear_cross_entropy import linear_cross_entropy

losses, predicted = linear_cross_entropy(hidden, kernel, labels)   # (tokens,), float32
loss = ops.mean(losses)
```
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

__all__ = ["DEFAULT_CHUNK_BYTES", "chunk_for", "linear_cross_entropy"]

# One chunk's float32 logits take at most this many bytes (at least 128 columns): 64 MiB,
# so a 2048-token sequence gets 8,192-word chunks (16 for Llama-3's vocabulary). Compiled
# for an H200 (benchmarks/fused_loss_memory.py), 2048 tokens x 128,256 words: the loss's
# temporaries are 0.13-0.18 GiB with 4,096-8,192-word chunks, 0.99 GiB with 32,768 (a few
# chunk-sized float32 buffers), 0.49 GiB for the plain loss's bfloat16 logits.
DEFAULT_CHUNK_BYTES = 64 * 2**20
_MIN_CHUNK = 128


def chunk_for(tokens: int, vocabulary: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Columns per chunk: as many as keep `tokens x chunk` float32 logits under
    `chunk_bytes`, a multiple of 128, at least 128, at most the vocabulary.

    Args:
        tokens: rows of the hidden states.
        vocabulary: columns of the logits.
        chunk_bytes: the budget of one chunk's float32 logits.

    Returns:
        An int.
    """
    columns = chunk_bytes // (4 * max(1, tokens))
    columns = max(_MIN_CHUNK, columns // _MIN_CHUNK * _MIN_CHUNK)
    return int(min(vocabulary, columns))


def linear_cross_entropy(
    hidden,
    kernel,
    labels,
    *,
    transposed: bool = False,
    valid=None,
    logit_soft_cap: float | None = None,
    compute_dtype: str | None = None,
    chunk: int | None = None,
):
    """Per-token cross-entropy of `hidden @ kernel` against `labels`, in float32, without
    making the logits whole.

    Args:
        hidden: `(..., H)` floating hidden states (any float dtype).
        kernel: `(H, V)` (a `Dense` kernel, an untied `ReversibleEmbedding`'s
            `reverse_embeddings`), or `(V, H)` with `transposed=True` (a tied
            embedding table: the logits are `hidden @ kernel.T`).
        labels: integer ids of `hidden.shape[:-1]`.
        transposed: whether `kernel` is `(V, H)`.
        valid: optional boolean mask of `labels`' shape: positions outside it get zero loss
            and give zero gradient (`ignore_class`; padding).
        logit_soft_cap: optional cap `c`: the logits are `c * tanh(z / c)`.
        compute_dtype: optional dtype the matmul inputs are cast to (a layer's
            `reverse_dtype`); default: as given. Products accumulate in float32.
        chunk: vocabulary columns per chunk (default `chunk_for(tokens, V)`).

    Returns:
        `(losses, predicted)`: float32 `logsumexp(z) - z[label]` of `labels`' shape (0
        where not `valid`) and the int32 argmax of each position's logits (the first of
        equal ones, as `argmax`), for accuracy metrics; only `losses` has a gradient.
    """
    backend = keras.backend.backend()
    if backend not in ("jax", "tensorflow"):
        raise NotImplementedError(
            f"linear_cross_entropy: the {backend} backend is not supported; use JAX or "
            "TensorFlow, or the plain loss on the logits."
        )
    shape = tuple(labels.shape)
    width = int(hidden.shape[-1])
    if int(kernel.shape[1 if transposed else 0]) != width:
        raise ValueError(
            f"linear_cross_entropy: hidden states of width {width} do not match a kernel of "
            f"shape {tuple(kernel.shape)} (transposed={transposed})."
        )
    vocabulary = int(kernel.shape[0 if transposed else 1])
    # a TensorFlow graph's unknown batch: the chunk is sized as for 8 rows a None
    tokens = math.prod(8 if d is None else int(d) for d in shape)
    h = ops.reshape(hidden, (-1, width))
    y = ops.reshape(ops.cast(labels, "int32"), (-1,))
    ok = ops.ones_like(y, "bool") if valid is None else ops.reshape(valid, (-1,))
    y = ops.where(ok, y, 0)
    if compute_dtype is not None:
        h = ops.cast(h, compute_dtype)
    size = chunk or chunk_for(tokens, vocabulary)
    spec = _Spec(vocabulary, min(size, vocabulary), transposed, logit_soft_cap, compute_dtype)
    run = _jax_op if backend == "jax" else _tf_op
    losses, predicted = run(spec, h, kernel, y, ok)
    out_shape = ops.shape(labels)
    return ops.reshape(losses, out_shape), ops.reshape(predicted, out_shape)


class _Spec:
    """What the op is specialised on (static)."""

    def __init__(self, vocabulary, chunk, transposed, cap, compute_dtype):
        self.vocabulary = vocabulary
        self.chunk = chunk
        self.full = vocabulary // chunk  # whole chunks, then a tail of `vocabulary % chunk`
        self.tail = vocabulary % chunk
        self.transposed = transposed
        self.cap = cap
        self.compute_dtype = compute_dtype


# -- one chunk's arithmetic (keras.ops; the backends' drivers below) ------------------


def _logits(spec, h, w, dot):
    """float32 logits of one chunk (`w`: the chunk's `(H, c)` or `(c, H)` columns) and
    the soft cap's `tanh` (None without a cap)."""
    if spec.compute_dtype is not None:
        w = ops.cast(w, spec.compute_dtype)
    z = dot(h, w, spec.transposed)
    if spec.cap is None:
        return z, None
    t = ops.tanh(z * (1.0 / spec.cap))
    return t * spec.cap, t


def _fold(spec, z, start, y, carry):
    """The running `(max, sum of exp, picked logit, argmax)` after chunk `z` (columns
    `start ...`)."""
    top, total, picked, best = carry
    width = z.shape[1]
    chunk_top = ops.max(z, axis=1)
    new_top = ops.maximum(top, chunk_top)
    total = total * ops.exp(top - new_top) + ops.sum(
        ops.exp(z - ops.expand_dims(new_top, 1)), axis=1
    )
    local = y - start
    inside = ops.logical_and(local >= 0, local < width)
    at = ops.expand_dims(ops.clip(local, 0, width - 1), 1)
    picked = picked + ops.where(inside, ops.squeeze(ops.take_along_axis(z, at, axis=1), 1), 0.0)
    chunk_best = ops.cast(ops.argmax(z, axis=1), "int32") + start
    best = ops.where(chunk_top > top, chunk_best, best)  # strict: the first maximum wins
    return new_top, total, picked, best


def _chunk_grad(spec, z, t, start, y, lse, g):
    """`d loss / d z` of one chunk (float32): `(softmax - one_hot) * g`, through the cap."""
    width = z.shape[1]
    probs = ops.exp(z - ops.expand_dims(lse, 1))
    hot = ops.equal(ops.expand_dims(y - start, 1), ops.arange(width, dtype="int32"))
    d = (probs - ops.cast(hot, "float32")) * ops.expand_dims(g, 1)
    if t is not None:
        d = d * (1.0 - t * t)
    return d


def _init(tokens):
    return (
        ops.full((tokens,), -np.inf, "float32"),
        ops.zeros((tokens,), "float32"),
        ops.zeros((tokens,), "float32"),
        ops.zeros((tokens,), "int32"),
    )


def _finish(carry, ok):
    top, total, picked, best = carry
    lse = top + ops.log(total)
    losses = ops.where(ok, lse - picked, 0.0)
    return losses, best, lse


# -- JAX ---------------------------------------------------------------------------


def _jax_dot(h, w, transposed):
    from jax import lax

    dims = (((1,), (1,)), ((), ())) if transposed else (((1,), (0,)), ((), ()))
    import jax.numpy as jnp

    return lax.dot_general(h, w, dims, preferred_element_type=jnp.float32)


def _jax_slice(spec, w, start, width):
    from jax import lax

    if spec.transposed:
        return lax.dynamic_slice_in_dim(w, start, width, axis=0)
    return lax.dynamic_slice_in_dim(w, start, width, axis=1)


def _jax_forward(spec, h, w, y, ok):
    from jax import lax

    def body(i, carry):
        start = i * spec.chunk
        z, _ = _logits(spec, h, _jax_slice(spec, w, start, spec.chunk), _jax_dot)
        return _fold(spec, z, start, y, carry)

    carry = lax.fori_loop(0, spec.full, body, _init(h.shape[0]))
    if spec.tail:
        start = spec.full * spec.chunk
        z, _ = _logits(spec, h, _jax_slice(spec, w, start, spec.tail), _jax_dot)
        carry = _fold(spec, z, start, y, carry)
    return _finish(carry, ok)


def _jax_backward(spec, h, w, y, ok, lse, g):
    import jax.numpy as jnp
    from jax import lax

    g = jnp.where(ok, g.astype(jnp.float32), 0.0)
    low = h.dtype

    def chunk_grads(start, width, dh, dw):
        wc = _jax_slice(spec, w, start, width)
        z, t = _logits(spec, h, wc, _jax_dot)
        d = _chunk_grad(spec, z, t, start, y, lse, g).astype(low)
        wc = wc.astype(low)
        if spec.transposed:  # z = h @ wc.T: dh += d @ wc, dwc = d.T @ h
            dh = dh + lax.dot_general(
                d, wc, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            dwc = lax.dot_general(
                d, h, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            dw = lax.dynamic_update_slice_in_dim(dw, dwc.astype(dw.dtype), start, axis=0)
        else:  # z = h @ wc: dh += d @ wc.T, dwc = h.T @ d
            dh = dh + lax.dot_general(
                d, wc, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            dwc = lax.dot_general(
                h, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            dw = lax.dynamic_update_slice_in_dim(dw, dwc.astype(dw.dtype), start, axis=1)
        return dh, dw

    def body(i, carry):
        return chunk_grads(i * spec.chunk, spec.chunk, *carry)

    dh = jnp.zeros(h.shape, jnp.float32)
    dw = jnp.zeros(w.shape, w.dtype)
    dh, dw = lax.fori_loop(0, spec.full, body, (dh, dw))
    if spec.tail:
        dh, dw = chunk_grads(spec.full * spec.chunk, spec.tail, dh, dw)
    return dh.astype(h.dtype), dw


def _jax_op(spec, h, w, y, ok):
    import jax

    @jax.custom_vjp
    def op(h, w, y, ok):
        losses, best, _ = _jax_forward(spec, h, w, y, ok)
        return losses, best

    def forward(h, w, y, ok):
        losses, best, lse = _jax_forward(spec, h, w, y, ok)
        return (losses, best), (h, w, y, ok, lse)

    def backward(residuals, cotangents):
        h, w, y, ok, lse = residuals
        dh, dw = _jax_backward(spec, h, w, y, ok, lse, cotangents[0])
        float0 = jax.dtypes.float0
        return dh, dw, np.zeros(y.shape, float0), np.zeros(ok.shape, float0)

    op.defvjp(forward, backward)
    return op(h, w, y, ok)


# -- TensorFlow ----------------------------------------------------------------------


def _tf_dot(h, w, transposed):
    import tensorflow as tf

    return tf.matmul(tf.cast(h, tf.float32), tf.cast(w, tf.float32), transpose_b=bool(transposed))


def _tf_slice(spec, w, start, width):
    return w[start : start + width] if spec.transposed else w[:, start : start + width]


def _tf_chunks(spec):
    starts = [i * spec.chunk for i in range(spec.full)]
    widths = [spec.chunk] * spec.full
    if spec.tail:
        starts.append(spec.full * spec.chunk)
        widths.append(spec.tail)
    return list(zip(starts, widths))


def _tf_op(spec, h, w, y, ok):
    import tensorflow as tf

    @tf.custom_gradient
    def op(h, w):
        carry = _init(tf.shape(h)[0])
        for start, width in _tf_chunks(spec):
            z, _ = _logits(spec, h, _tf_slice(spec, w, start, width), _tf_dot)
            carry = _fold(spec, z, start, y, carry)
        losses, best, lse = _finish(carry, ok)

        def grad(upstream, unused=None, variables=None):
            g = tf.where(ok, tf.cast(upstream, tf.float32), 0.0)
            hf = tf.cast(h, tf.float32)
            dh = tf.zeros_like(hf)
            dws = []
            for start, width in _tf_chunks(spec):
                wc = _tf_slice(spec, w, start, width)
                z, t = _logits(spec, h, wc, _tf_dot)
                d = tf.cast(_chunk_grad(spec, z, t, start, y, lse, g), h.dtype)
                d = tf.cast(d, tf.float32)
                wcf = tf.cast(tf.cast(wc, h.dtype), tf.float32)
                if spec.transposed:
                    dh += tf.matmul(d, wcf)
                    dws.append(tf.matmul(d, hf, transpose_a=True))
                else:
                    dh += tf.matmul(d, wcf, transpose_b=True)
                    dws.append(tf.matmul(hf, d, transpose_a=True))
            dw = tf.concat(dws, axis=0 if spec.transposed else 1)
            grads = (tf.cast(dh, h.dtype), tf.cast(dw, w.dtype))
            if variables:
                return grads, [None] * len(variables)
            return grads

        return (losses, tf.stop_gradient(best)), grad

    return op(h, w)
