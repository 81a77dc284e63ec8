"""`model.fit` time a step against `steps_per_execution`: how much of a step is the host's.

Issue 49.1. The harness (`benchmarks/run.py`) times `train_on_batch`, one host dispatch a
step; users run `model.fit`, where `steps_per_execution=N` hands the device N steps per
dispatch (Keras 3.16 on JAX: one on-device `lax.scan`; Keras <= 3.15: a host loop over the
compiled step). Each row: one workload under one harness policy at one
`steps_per_execution`, a first `fit` epoch that compiles (untimed), then `--rounds` timed
epochs of `--steps` steps over the same batch repeated; `step_ms` is the median epoch's wall
time per step. The host's share of a step at N=1 is about `1 - step_ms(N=64) / step_ms(N=1)` where
the device work is the same.

    KERAS_BACKEND=jax python benchmarks/fit_steps.py --models tiny_gpt,cpu_gpt \\
        --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_lean_bfloat16 \\
        --steps-per-execution 1,4,16,64 --steps 128 --out fit.jsonl
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fit_record(model_name: str, policy: str, spe: int, steps: int, rounds: int = 5) -> dict:
    """Times `rounds` `fit` epochs of `steps` steps at `steps_per_execution=spe`; the
    median epoch gives `step_ms` (the fastest, `step_ms_min`)."""
    import statistics

    import keras
    import numpy as np

    from keras_mp.cli.measure import POLICIES, _compiled_model, _names
    from keras_mp.cli.workloads import WORKLOADS

    _names("policy", policy, POLICIES)
    if steps % spe:
        raise ValueError(f"--steps ({steps}) must be a multiple of steps_per_execution ({spe})")
    workload = WORKLOADS[model_name]
    previous = keras.config.dtype_policy()
    try:
        model = _compiled_model(workload, policy, True, None, steps_per_execution=spe)
    finally:
        keras.config.set_dtype_policy(previous)
    x, y = workload.data(np.random.default_rng(0))
    batch = len(x)
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    start = time.perf_counter()
    model.fit(xs[: batch * spe], ys[: batch * spe], batch_size=batch, shuffle=False, verbose=0)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        history = model.fit(xs, ys, batch_size=batch, shuffle=False, verbose=0)
        times.append((time.perf_counter() - start) / steps * 1e3)
    step_ms = statistics.median(times)
    keras.backend.clear_session()
    return {
        "kind": "fit",
        "model": model_name,
        "policy": policy,
        "steps_per_execution": spe,
        "steps": steps,
        "step_ms": round(step_ms, 3),
        "step_ms_min": round(min(times), 3),
        "rounds": rounds,
        "tflops": round(workload.flops_per_step() / (step_ms / 1e3) / 1e12, 4),
        "compile_s": round(compile_s, 2),
        "loss": float(history.history["loss"][-1]),
        "backend": keras.backend.backend(),
        "keras": keras.__version__,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny_gpt")
    parser.add_argument(
        "--policies", default="stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_lean_bfloat16"
    )
    parser.add_argument("--steps-per-execution", default="1,4,16,64")
    parser.add_argument("--steps", type=int, default=128, help="timed steps a row")
    parser.add_argument("--rounds", type=int, default=5, help="timed epochs a row (median)")
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    from keras_mp.cli.records import emit

    for model_name in args.models.split(","):
        for spe in (int(n) for n in args.steps_per_execution.split(",")):
            for policy in args.policies.split(","):
                emit(fit_record(model_name, policy, spe, args.steps, args.rounds), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
