"""Where the lean update's time goes, by state format: one model dominated by two large
variables, its step under each lean format side by side with `mixed_bfloat16`.

    KERAS_BACKEND=jax python benchmarks/lean_formats.py                  # a GPU: 67M values
    KERAS_BACKEND=jax python benchmarks/lean_formats.py --vocab 4096 --width 256   # a CPU

The model: token ids (batch x 16) -> Embedding(vocab, width) -> Dense(vocab) head, so that
nearly all of its values are in two large variables and its forward and backward passes
are small beside the update. Variants, each its own compiled model in this one process:
`sgd` (keras_mp `mixed_bfloat16` with plain SGD: the step without the optimizer's work, the
floor), `adamw` (keras_mp `mixed_bfloat16`, float32 AdamW: 12 bytes a parameter), and
`lean_bfloat16` with AdamW and each (rounding, moments) pair given in `--lean` (a third
field `:pallas` runs that pair's update as `keras_mp.lean.kernel`'s Pallas kernel, as
`KERAS_MP_LEAN_KERNEL=pallas` does). Each round
times `--steps` `train_on_batch` calls of every variant, the order reversed every other
round. Prints one JSON line: each variant's median step (ms), and its update's time over
the `sgd` floor, as a multiple of AdamW's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_LEAN = "stochastic:int4,stochastic:int8,stochastic:bfloat16,kahan:int8,stochastic:float32"


def build(keras, vocab: int, width: int, length: int):
    tokens = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, width, name="embed")(tokens)
    logits = keras.layers.Dense(vocab, name="head")(h)
    return keras.Model(tokens, logits)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lean", default=DEFAULT_LEAN, help="rounding:moments pairs")
    args = p.parse_args(argv)

    import keras
    import numpy as np

    import keras_mp as kmp

    keras.utils.set_random_seed(0)
    base = build(keras, args.vocab, args.width, args.length)
    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocab, size=(args.batch, args.length)).astype("int32")
    y = rng.integers(0, args.vocab, size=(args.batch, args.length)).astype("int32")
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)

    variants = {}
    first = {}
    for name in ("sgd", "adamw", *args.lean.split(",")):
        if name in ("sgd", "adamw"):
            model = kmp.convert(base, "mixed_bfloat16")
            optimizer = (
                keras.optimizers.SGD(1e-3)
                if name == "sgd"
                else keras.optimizers.AdamW(1e-3, weight_decay=0.01)
            )
        else:
            rounding, moments, *kernel = name.split(":")
            model = kmp.convert(base, "lean_bfloat16")
            optimizer = kmp.LeanOptimizer(
                keras.optimizers.AdamW(1e-3, weight_decay=0.01),
                rounding=rounding,
                moments=moments,
            )
            if kernel:
                optimizer._kernel = kernel[0]
        model.compile(optimizer=optimizer, loss=loss)
        start = time.perf_counter()
        model.train_on_batch(x, y)
        first[name] = round(time.perf_counter() - start, 2)
        model.train_on_batch(x, y)
        variants[name] = model
        print(f"# {name}: first step {first[name]} s", file=sys.stderr, flush=True)

    times = {n: [] for n in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            model = variants[name]
            for _ in range(args.steps):
                start = time.perf_counter()
                model.train_on_batch(x, y)
                times[name].append(time.perf_counter() - start)
    median = {n: 1e3 * statistics.median(t) for n, t in times.items()}
    floor = median["sgd"]
    adamw_update = median["adamw"] - floor
    row = {
        "backend": keras.backend.backend(),
        "device": str(keras.backend.backend() == "jax" and __import__("jax").devices()[0]),
        "values": int(base.count_params()),
        "step_ms_median": {n: round(v, 3) for n, v in median.items()},
        "step_ms_min": {n: round(1e3 * min(t), 3) for n, t in times.items()},
        "update_ms_over_sgd": {n: round(v - floor, 3) for n, v in median.items()},
        "update_vs_adamw": {
            n: round((v - floor) / adamw_update, 3) if adamw_update > 0 else None
            for n, v in median.items()
        },
        "first_step_s": first,
    }
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
