"""What skipping non-finite steps costs a step that has none (issue 46.2).

    python benchmarks/skip_cost.py                  # KERAS_BACKEND picks the backend
    KERAS_BACKEND=jax python benchmarks/skip_cost.py --rounds 5

One float32 MLP (64 -> 1024 -> 1024 -> 10, about 1.1M parameters, batch 256) is converted
to `mixed_bfloat16` and `lean_bfloat16`, and each is compiled two ways with AdamW:

- mixed: `auto_scale_loss=False` (the plain AdamW, as before) against the default, the
  fixed scale of 1 (`kmp.LossScaleOptimizer(initial_scale=1, dynamic=False)`: one
  finiteness test of the gradients and a select, inside the compiled step);
- lean: the update without the whole-step test and counter (`LeanOptimizer.apply` as it
  was: each variable guarded alone) against the default (the test, the NaN select on
  every gradient, the `skipped_steps` counter).

`--rounds` times, each pair runs `--steps` timed `train_on_batch` calls (synchronous),
alternating in ABBA order so load on a shared machine hits both alike. A round's ratio is
the default's median step over the other's; printed: the median ratio over rounds and its
spread. Steps are timed in CPU time (`--clock cpu`, all threads of the process) by
default: on a shared machine elapsed time mostly measures the other jobs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import keras
import numpy as np

import keras_mp as kmp
from keras_mp.lean.rule import to_float32


class _LeanUnguarded(kmp.LeanOptimizer):
    """The lean update as it was before the whole-step test: variables guarded alone."""

    def apply(self, grads, trainable_variables=None):
        grads = [None if g is None else to_float32(g) for g in grads]
        return keras.optimizers.Optimizer.apply(self, grads, trainable_variables)


def _mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _compiled(base, policy: str, variant: str) -> keras.Model:
    model = kmp.convert(base, policy)
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.AdamW(1e-3)
    if policy == "lean_bfloat16" and variant == "off":
        opt = _LeanUnguarded(opt)
    model.compile(
        opt, loss=loss, auto_scale_loss=not (policy == "mixed_bfloat16" and variant == "off")
    )
    return model


def _median_step(model, x, y, steps: int, clock=time.process_time) -> float:
    times = []
    for _ in range(steps):
        start = clock()
        float(model.train_on_batch(x, y))
        times.append(clock() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu (default): the process's CPU time per step, all threads (what the step "
        "costs, less swayed by other jobs on a shared machine); wall: elapsed time",
    )
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 64)).astype("float32")
    y = rng.integers(0, 10, 256).astype("int32")
    base = _mlp()
    out = {
        "backend": keras.backend.backend(),
        "parameters": base.count_params(),
        "clock": args.clock,
    }
    for policy in ("mixed_bfloat16", "lean_bfloat16"):
        pair = {v: _compiled(base, policy, v) for v in ("off", "on")}
        for model in pair.values():
            _median_step(model, x, y, 5)  # compile and warm up
        assert type(pair["on"].optimizer).__name__ in ("LossScaleOptimizer", "LeanOptimizer")
        ratios = []
        for r in range(args.rounds):
            order = ("off", "on", "on", "off") if r % 2 == 0 else ("on", "off", "off", "on")
            seen: dict = {"off": [], "on": []}
            for v in order:
                seen[v].append(_median_step(pair[v], x, y, args.steps // 2, clock))
            ratios.append(statistics.mean(seen["on"]) / statistics.mean(seen["off"]))
        out[policy] = {
            "ratio": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
