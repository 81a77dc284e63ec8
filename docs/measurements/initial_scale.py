"""Step-1 overflow vs initial loss scale, on the client examples and keras.applications.

Run from the repository root: `KERAS_BACKEND=tensorflow python docs/measurements/initial_scale.py`
(docs/loss-scaling.md, "Choosing the initial scale (measured)", has the results).
"""

import sys

import keras
import numpy as np

import keras_mp as kmp

sys.path.insert(0, "tests/integration")
import client_examples as ce  # noqa: E402

_LM_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _application(name, seed):
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    model = getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=10)
    x = rng.uniform(0, 255, (8, 32, 32, 3)).astype("float32")
    return model, (x, rng.integers(0, 10, 8))


def skipped_steps(kind, exponent, seed=0, epochs=1, steps_per_epoch=1) -> list:
    """The steps (1-based) of a fit that were skipped for non-finite gradients."""
    model, data = ce.build(kind, seed) if kind in ce.KINDS else _application(kind, seed)
    mixed = kmp.convert(model, "mixed_float16", check=None)
    if kind == "float8":
        mixed.quantize("float8")
    inner = keras.optimizers.Adam()
    opt = kmp.LossScaleOptimizer(inner, initial_scale=2.0**exponent)
    loss = {"custom_loss": None, "lora": _LM_LOSS, "siamese": "mse"}.get(
        kind, "sparse_categorical_crossentropy")
    mixed.compile(optimizer=opt, loss=loss)
    fit_data = dict(zip(("x", "y", "sample_weight"), data))
    counts = []
    read = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: counts.append(
        int(keras.ops.convert_to_numpy(opt.skipped_steps.value))))
    mixed.fit(**fit_data, batch_size=8, epochs=epochs, steps_per_epoch=steps_per_epoch,
              verbose=0, callbacks=[read])
    return [i + 1 for i, c in enumerate(counts) if c > (counts[i - 1] if i else 0)]


if __name__ == "__main__":
    # The client examples' own fits (3 epochs of 2 steps), three seeds each; then step 1
    # of MobileNetV2.
    for kind in ce.KINDS:
        for seed in (0, 1, 2):
            for exponent in (16, 15, 14):
                skipped = skipped_steps(kind, exponent, seed, epochs=3, steps_per_epoch=None)
                print(kind, f"seed={seed}", f"2^{exponent}", "skipped steps:", skipped, flush=True)
    for exponent in (16, 15, 14):
        print("MobileNetV2", f"2^{exponent}", "skipped steps:",
              skipped_steps("MobileNetV2", exponent), flush=True)
