"""A custom JAX training loop: `stateless_call`, `scale_loss` and `stateless_apply`.

JAX is functional: the model, the optimizer and the loss scale live in arrays that the
jitted step takes and returns. The loss is scaled inside a `keras.StatelessScope` mapped to
the optimizer's current variable values, and `kmp.LossScaleOptimizer.stateless_apply`
unscales the gradients in float32, skips non-finite steps, clips (the inner optimizer's
`global_clipnorm` sees the true gradients) and updates the scale, all inside `jax.jit`.

It runs `mixed_bfloat16` by default (bfloat16 has the range of float32 and rarely needs a
loss scale, but the mechanics are identical); KERAS_MP_EXAMPLE_POLICY=mixed_float16 runs
it in float16, on JAX's CPU too (JAX 0.10.2: float16 Conv2D and Dense run there; only a
dot with float32 accumulation, as in `MultiHeadAttention`'s einsums, has no CPU kernel).

    python examples/custom_loop_jax.py
    KERAS_MP_EXAMPLE_FAST=1 python examples/custom_loop_jax.py
"""

import os

os.environ["KERAS_BACKEND"] = "jax"

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp import losses  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
POLICY = os.environ.get("KERAS_MP_EXAMPLE_POLICY", "mixed_bfloat16")
EPOCHS = 3 if FAST else 15

digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., None]
y = digits.target.astype("int32")
x_train, y_train, x_val, y_val = x[:1400], y[:1400], x[1400:], y[1400:]
if FAST:
    x_train, y_train = x_train[:480], y_train[:480]

keras.utils.set_random_seed(0)
kmp.set_global_policy(POLICY)
model = keras.Sequential(
    [
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dense(10, dtype="float32"),  # float32 logits
    ]
)
kmp.set_global_policy("float32")
optimizer = kmp.LossScaleOptimizer(
    keras.optimizers.Adam(1e-3, global_clipnorm=1.0), initial_scale=2.0**15
)
optimizer.build(model.trainable_variables)
loss_fn = losses.SparseCategoricalCrossentropy(from_logits=True)


def compute_loss(trainable, non_trainable, opt_vars, images, labels):
    logits, non_trainable = model.stateless_call(trainable, non_trainable, images, training=True)
    loss = loss_fn(labels, logits)
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, opt_vars, strict=True))):
        scaled = optimizer.scale_loss(loss)  # reads the current scale from opt_vars
    return scaled, (loss, non_trainable)


grad_fn = jax.value_and_grad(compute_loss, has_aux=True)


@jax.jit
def train_step(state, images, labels):
    trainable, non_trainable, opt_vars = state
    (_, (loss, non_trainable)), grads = grad_fn(trainable, non_trainable, opt_vars, images, labels)
    trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
    return loss, (trainable, non_trainable, opt_vars)


state = (
    [v.value for v in model.trainable_variables],
    [v.value for v in model.non_trainable_variables],
    [v.value for v in optimizer.variables],
)
rng = np.random.default_rng(0)
for epoch in range(EPOCHS):
    order = rng.permutation(len(x_train))
    for i in range(0, len(order) - 31, 32):
        batch = order[i : i + 32]
        loss, state = train_step(state, x_train[batch], y_train[batch])
    print(f"epoch {epoch + 1}: loss {float(loss):.4f}")

# Write the final state back into the Keras objects.
for variable, value in zip(model.trainable_variables, state[0], strict=True):
    variable.assign(value)
for variable, value in zip(model.non_trainable_variables, state[1], strict=True):
    variable.assign(value)
for variable, value in zip(optimizer.variables, state[2], strict=True):
    variable.assign(value)

acc = float(np.mean(np.argmax(model.predict(x_val, verbose=0), -1) == y_val))
scale = float(keras.ops.convert_to_numpy(optimizer.loss_scale))
skipped = int(keras.ops.convert_to_numpy(optimizer.skipped_steps))
print(f"{POLICY}: validation accuracy {acc:.3f}; loss scale {scale:g}, skipped steps {skipped}")
