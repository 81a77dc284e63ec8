"""Watch the loss scale and skipped steps in TensorBoard while training.

`kmp.callbacks.LossScaleMonitor(log_dir=...)` writes `loss_scale` and `skipped_steps`
(per step) and `epoch_loss_scale`, `epoch_skipped_steps`, `epoch_overflow_rate` (per
epoch) next to the losses that `keras.callbacks.TensorBoard` writes to the same directory.
The script reads the event files back to show what was logged; view them with

    tensorboard --logdir <the printed directory>

    python examples/tensorboard_monitoring.py
    KERAS_MP_EXAMPLE_FAST=1 python examples/tensorboard_monitoring.py
"""

import os

os.environ["KERAS_BACKEND"] = os.environ.get("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import collections  # noqa: E402
import glob  # noqa: E402
import importlib.util  # noqa: E402
import tempfile  # noqa: E402

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp import callbacks, losses  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
LOG_DIR = os.environ.get("KERAS_MP_EXAMPLE_OUT") or tempfile.mkdtemp(prefix="keras_mp_tb_")
os.makedirs(LOG_DIR, exist_ok=True)

digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., None]
y = digits.target

keras.utils.set_random_seed(0)
inputs = keras.Input((8, 8, 1))
h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
h = keras.layers.Flatten()(h)
model = kmp.convert(keras.Model(inputs, keras.layers.Dense(10)(h)), "mixed_float16")
optimizer = kmp.LossScaleOptimizer(
    keras.optimizers.Adam(1e-3), initial_scale=2.0**20, growth_interval=20
)
model.compile(
    optimizer=optimizer,
    loss=losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
    jit_compile=True,
)
n_train = 320 if FAST else 1400
model.fit(
    x[:n_train],
    y[:n_train],
    epochs=2 if FAST else 8,
    batch_size=32,
    verbose=0,
    validation_data=(x[1400:], y[1400:]),
    callbacks=[
        # First, so the callbacks after it see loss_scale / skipped_steps in the logs.
        callbacks.LossScaleMonitor(
            log_dir=LOG_DIR, every_n_steps=5, log_format="auto" if HAVE_TENSORBOARD else "csv"
        ),
        keras.callbacks.TensorBoard(log_dir=LOG_DIR)
        if HAVE_TENSORBOARD
        else keras.callbacks.CSVLogger(os.path.join(LOG_DIR, "epochs.csv")),
    ],
)
if not HAVE_TENSORBOARD:
    print("TensorBoard is not installed (pip install tensorboard): wrote CSV logs instead.")
    for name in sorted(os.listdir(LOG_DIR)):
        with open(os.path.join(LOG_DIR, name)) as f:
            lines = f.read().splitlines()
        print(f"  {name}: {len(lines)} lines, last: {lines[-1]}")
    raise SystemExit(0)

# Read the scalars back (TensorFlow's event reader; the TensorBoard UI shows the same).
import tensorflow as tf  # noqa: E402

series = collections.defaultdict(list)
for path in glob.glob(os.path.join(LOG_DIR, "**", "events.out.tfevents.*"), recursive=True):
    for record in tf.data.TFRecordDataset(path):
        event = tf.compat.v1.Event.FromString(record.numpy())
        for value in event.summary.value:
            if value.HasField("tensor"):  # scalars; skip the model graph and text summaries
                array = tf.make_ndarray(value.tensor)
                if array.size == 1 and array.dtype.kind in "fiu":
                    series[value.tag].append((event.step, float(array)))
            elif value.HasField("simple_value"):
                series[value.tag].append((event.step, value.simple_value))
print(f"TensorBoard logs in {LOG_DIR}")
for tag in sorted(series):
    points = sorted(series[tag])
    print(f"  {tag:<22} {len(points):3d} points, last (step {points[-1][0]}) = {points[-1][1]:g}")
print(f"run: tensorboard --logdir {LOG_DIR}")
