"""Train a BatchNorm CNN with `model.fit` under mixed float16.

The canonical recipe in a few lines: a policy with FP32 master weights, batch-norm
statistics and the loss math in float32 (`kmp.convert` applies the keep-list: Keras'
BatchNormalization computes its statistics in float32 itself, and the logits projection keeps
its fast float16 matmul because `kmp.losses` take the log-softmax in float32), dynamic loss
scaling, and callbacks that show the loss scale and stop on a collapse.

    python examples/cnn_fit.py              # about a minute on a laptop CPU
    KERAS_MP_EXAMPLE_FAST=1 python examples/cnn_fit.py

On a CPU without fast float16, `mixed_bfloat16` is the better policy (see `keras-mp doctor`).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp import callbacks, losses  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
DEFAULT_POLICY = "mixed_float16"
if keras.backend.backend() == "jax":  # JAX on CPU has no float16 matmul: bfloat16 there
    import jax

    DEFAULT_POLICY = "mixed_bfloat16" if jax.default_backend() == "cpu" else "mixed_float16"
POLICY = os.environ.get("KERAS_MP_EXAMPLE_POLICY", DEFAULT_POLICY)
EPOCHS = 2 if FAST else 10

digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., None]
y = digits.target
x_train, y_train, x_val, y_val = x[:1400], y[:1400], x[1400:], y[1400:]
if FAST:
    x_train, y_train = x_train[:320], y_train[:320]

keras.utils.set_random_seed(0)


def cnn():
    inputs = keras.Input((8, 8, 1))
    h = inputs
    for filters in (16, 32):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
    h = keras.layers.Flatten()(keras.layers.MaxPooling2D()(h))
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(h))


# Build in float32, then convert: BN keeps FP32 statistics inside, the loss is FP32 math.
model = kmp.convert(cnn(), POLICY)
for layer in model.layers[1:]:
    print(f"  {layer.name:<22} {layer.dtype_policy.name}")

optimizer = keras.optimizers.Adam(1e-3)
if POLICY == "mixed_float16":
    optimizer = kmp.LossScaleOptimizer(optimizer)  # float16 gradients need loss scaling
model.compile(
    optimizer=optimizer,
    loss=losses.SparseCategoricalCrossentropy(from_logits=True),  # float32 math
    metrics=["accuracy"],
    jit_compile=True if POLICY.endswith("_float16") else "auto",  # TF: float16 is fast under XLA
)
cbs = [callbacks.CollapseGuard()]
if POLICY == "mixed_float16":
    cbs.insert(0, callbacks.LossScaleMonitor())  # adds loss_scale/skipped_steps to the logs
history = model.fit(
    x_train,
    y_train,
    batch_size=32,
    epochs=EPOCHS,
    validation_data=(x_val, y_val),
    callbacks=cbs,
    verbose=2,
)
loss, acc = model.evaluate(x_val, y_val, verbose=0)
print(f"{POLICY}: validation accuracy {acc:.3f}, loss {loss:.4f}")
if POLICY == "mixed_float16":
    scale = keras.ops.convert_to_numpy(optimizer.loss_scale)
    skipped = keras.ops.convert_to_numpy(optimizer.skipped_steps)
    print(f"loss scale {float(scale):g}, skipped steps {int(skipped)}")
