"""The training loops users write themselves, as Keras' guides write them: the TensorFlow
`GradientTape` loop ("Writing a training loop from scratch") and the JAX `stateless_call`
loop ("... in JAX"), each adding `model.losses` to the loss the guide's way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .families import N

if TYPE_CHECKING:
    from .programs import Program

__all__ = ["BATCH", "EPOCHS", "jax_loop", "tape_loop"]

BATCH, EPOCHS = 16, 5  # 3 steps per epoch, 15 steps


def _loss_of(p: Program, loss_fn, y, pred, model, sample_weight=None):
    """The loss a user's own loop computes: per output, plus `model.losses`."""
    if isinstance(pred, dict):
        total = sum(loss_fn(y[k], pred[k], sample_weight=sample_weight) for k in sorted(pred))
    else:
        total = loss_fn(y, pred, sample_weight=sample_weight)
    return total


def _batches(x, y, sw):
    take = lambda d, s: (
        {k: v[s] for k, v in d.items()} if isinstance(d, dict) else (None if d is None else d[s])
    )
    for start in range(0, N, BATCH):
        s = slice(start, start + BATCH)
        yield take(x, s), take(y, s), take(sw, s)


def tape_loop(p, model, opt, loss_fn, x, y, sw) -> list[float]:
    """Keras' "Writing a training loop from scratch" (TensorFlow), as written there."""
    import tensorflow as tf

    def step(xb, yb, swb):
        with tf.GradientTape() as tape:
            pred = model(xb, training=True)
            loss = _loss_of(p, loss_fn, yb, pred, model, swb)
            if model.losses:
                loss += sum(model.losses)
        grads = tape.gradient(loss, model.trainable_weights)
        opt.apply(grads, model.trainable_weights)
        return loss

    step = tf.function(step, jit_compile={"true": True, "false": False}.get(p.jit))
    history = []
    for _ in range(EPOCHS):
        losses = [float(step(*b)) for b in _batches(x, y, sw)]
        history.append(float(np.mean(losses)))
    return history


def jax_loop(p, model, opt, loss_fn, x, y, sw) -> list[float]:
    """Keras' "Writing a training loop from scratch in JAX", as written there."""
    import jax

    def compute_loss_and_updates(trainable, non_trainable, xb, yb, swb):
        pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, xb, training=True, return_losses=True
        )
        loss = _loss_of(p, loss_fn, yb, pred, model, swb)
        if losses:
            loss += sum(losses)
        return loss, non_trainable

    grad_fn = jax.value_and_grad(compute_loss_and_updates, has_aux=True)

    def train_step(state, data):
        trainable, non_trainable, opt_vars = state
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, *data)
        trainable, opt_vars = opt.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    if p.jit != "false":
        train_step = jax.jit(train_step)
    opt.build(model.trainable_variables)
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in opt.variables],
    )
    history = []
    for _ in range(EPOCHS):
        losses = []
        for b in _batches(x, y, sw):
            loss, state = train_step(state, b)
            losses.append(float(loss))
        history.append(float(np.mean(losses)))
    for var, value in zip(model.trainable_variables, state[0]):
        var.assign(value)
    for var, value in zip(model.non_trainable_variables, state[1]):
        var.assign(value)
    for var, value in zip(opt.variables, state[2]):
        var.assign(value)
    return history
