"""What TensorFlow's op determinism costs per train step, side by side in one process.

    KERAS_BACKEND=tensorflow python benchmarks/determinism_cost.py [--rounds 5] [--steps 30]

For each round and each setting (op determinism off, then on) a fresh small CNN is built
and compiled (`jit_compile=False`: TensorFlow's own kernels, where op determinism chooses
them), warmed up, and `--steps` train steps are timed. The settings alternate within each
round so that load on a shared machine hits both alike. Prints one JSON line per
(policy, setting) with the median step time, and the on/off ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _model(keras):
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(64, 3, strides=2, activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10, dtype="float32"),
    ])


def _time_steps(keras, x, y, steps: int) -> float:
    model = _model(keras)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(3):
        model.train_on_batch(x, y)
    start = time.perf_counter()
    for _ in range(steps):
        model.train_on_batch(x, y)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--policies", default="float32,mixed_bfloat16")
    args = p.parse_args()
    import keras
    import numpy as np
    from tensorflow.python.framework import config

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch,))
    for policy in args.policies.split(","):
        keras.config.set_dtype_policy(policy)
        times = {"off": [], "on": []}
        for _ in range(args.rounds):
            for setting in ("off", "on"):
                keras.utils.set_random_seed(0)
                if setting == "on":
                    config.enable_op_determinism()
                else:
                    config.disable_op_determinism()
                times[setting].append(_time_steps(keras, x, y, args.steps))
                keras.backend.clear_session()
        config.disable_op_determinism()
        med = {k: statistics.median(v) for k, v in times.items()}
        for setting, values in times.items():
            print(json.dumps({
                "policy": policy, "op_determinism": setting, "batch": args.batch,
                "median_step_ms": round(1e3 * med[setting], 2),
                "steps_ms": [round(1e3 * t, 2) for t in values],
            }), flush=True)
        print(json.dumps({"policy": policy, "on_over_off": round(med["on"] / med["off"], 3)}),
              flush=True)


if __name__ == "__main__":
    main()
