"""A custom TensorFlow training loop with loss scaling, unscaled gradients and clipping.

The three lines that matter:

    scaled = optimizer.scale_loss(loss)            # loss * current loss scale
    grads = tape.gradient(scaled, variables)       # scaled gradients (float16 keeps them)
    optimizer.apply(grads, variables)              # unscale in float32, skip if inf/NaN,
                                                   # clip (inner optimizer), update, adjust scale

`kmp.LossScaleOptimizer.apply` divides the gradients by the scale before the inner optimizer
sees them, so the inner optimizer's `global_clipnorm` clips the *true* gradients. A step whose
gradients overflow changes no weight and no optimizer slot; the scale backs off instead. The
loop starts from a deliberately large scale (2**24) to show the first overflowing steps
being skipped. TensorFlow backend only.

    python examples/custom_loop_tf.py
    KERAS_MP_EXAMPLE_FAST=1 python examples/custom_loop_tf.py
"""

import os

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp import losses  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
STEPS = 60 if FAST else 600

digits = load_digits()
x = tf.constant((digits.images / 16.0).astype("float32")[..., None])
y = tf.constant(digits.target, dtype="int32")
dataset = tf.data.Dataset.from_tensor_slices((x[:1400], y[:1400]))
dataset = dataset.shuffle(1400, seed=0).batch(32, drop_remainder=True).repeat()

keras.utils.set_random_seed(0)
kmp.set_global_policy("mixed_float16")
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
    keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=1.0),  # clips unscaled grads
    initial_scale=2.0**24,
    growth_interval=200,
)
optimizer.build(model.trainable_variables)
loss_fn = losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function(jit_compile=True)  # float16 on a CPU is fast only under XLA
def train_step(images, labels):
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = loss_fn(labels, logits)
        scaled = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    # For logging only: the true gradient norm (inf when this step overflowed).
    true_norm = tf.linalg.global_norm([tf.cast(g, "float32") for g in grads]) / (
        optimizer.loss_scale.value
    )
    optimizer.apply(grads, model.trainable_variables)
    return loss, true_norm


for step, (images, labels) in enumerate(dataset.take(STEPS)):
    loss, norm = train_step(images, labels)
    if step < 12 or step % (STEPS // 6) == 0:
        print(
            f"step {step:4d}  loss {float(loss):.4f}  true grad norm {float(norm):9.4f}  "
            f"scale {float(optimizer.loss_scale.numpy()):10g}  "
            f"skipped {int(optimizer.skipped_steps.numpy())}"
        )

logits = model(x[1400:], training=False)
acc = float(
    tf.reduce_mean(tf.cast(tf.argmax(logits, -1, output_type=tf.int32) == y[1400:], tf.float32))
)
print(
    f"validation accuracy {acc:.3f}; {int(optimizer.skipped_steps.numpy())} steps skipped, "
    f"{int(optimizer.iterations.numpy())} applied, final scale "
    f"{float(optimizer.loss_scale.numpy()):g}"
)
