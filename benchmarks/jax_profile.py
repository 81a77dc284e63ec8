"""Where a JAX train step spends its device time: kernels by kind, from JAX's profiler.

The harness times whole steps; this script says what fills them. It runs a workload's train
steps (a harness policy, XLA) under `jax.profiler.trace`, reads the trace back with
`jax.profiler.ProfileData` (no TensorBoard needed) and prints one JSON line per
configuration: the median step; the device's busy time per step (its kernels' durations
summed) by kind (`KINDS`: GEMM, attention, convolution, copies, other element-wise work);
kernels per step; the idle rest (step minus busy time: launch gaps, host work, waiting); and
the kernels that took the most time. On a GPU the kernels are the CUDA kernels on the
device's streams (kernels on concurrent streams overlap, so busy time can exceed the step);
on a CPU (dry runs) the XLA thunks on the PjRt client's threads, which overlap too. Each
configuration runs in its own process, like the harness (`@remat` sets its XLA flag there).

    KERAS_BACKEND=jax python benchmarks/jax_profile.py --models gpt \
        --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16 --steps 5
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
KINDS = ("gemm", "attention", "conv", "copy", "other")
_KIND_PATTERNS = (  # first match wins: cuDNN's implicit-GEMM convolutions say "gemm" too
    ("attention", re.compile(r"fmha|sdpa|flash|attention")),
    ("conv", re.compile(r"fprop|dgrad|wgrad|conv(?!ert)|cudnn.*convolution")),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|matmul|xmma|\bdot|_dot")),
    ("copy", re.compile(r"memcpy|memset|copy")),
)
_DERIVED = re.compile(r"XLA Ops|XLA Modules|Steps|Framework|Source|Launch")  # not kernels
_NOT_KERNELS = ("ThreadpoolListener", "end: ", "ThunkExecutor")  # markers, or around thunks


def kernel_kind(name: str) -> str:
    """The kind (`KINDS`) of a kernel, from its name as the profiler records it.

    Args:
        name: A CUDA kernel name (cuBLAS, cuDNN, an XLA fusion such as
            `loop_add_fusion_3` or a Triton `gemm_fusion_dot_12`) or an XLA:CPU thunk name.

    Returns:
        One of `KINDS`.
    """
    lowered = name.lower()
    return next((kind for kind, p in _KIND_PATTERNS if p.search(lowered)), "other")


def device_kernels(profile) -> tuple[str | None, list]:
    """The kernels of a trace: (plane name, [(kernel name, duration ns), ...]).

    Args:
        profile: A `jax.profiler.ProfileData`.

    Returns:
        The first GPU's plane and the kernels on its streams (its lines named `Stream ...`;
        if it has none, every line but the ones the profiler derives from the kernels, such
        as `XLA Ops`), or, without a GPU, the host plane and the XLA work on its PjRt/Eigen
        threads; `(None, [])` if the trace has neither.
    """
    planes = list(profile.planes)
    gpus = [p for p in planes if p.name.startswith("/device:GPU")]
    if gpus:
        plane = gpus[0]
        lines = [line for line in plane.lines if line.name.startswith("Stream")] or [
            line for line in plane.lines if not _DERIVED.search(line.name)
        ]
    else:
        plane = next((p for p in planes if p.name == "/host:CPU"), None)
        if plane is None:
            return None, []
        lines = [line for line in plane.lines if re.search(r"XLAPjRtCpuClient|XLAEigen", line.name)]
    kernels = [
        (event.name, event.duration_ns)
        for line in lines
        for event in line.events
        if event.duration_ns > 0 and not event.name.startswith(_NOT_KERNELS)
    ]
    return plane.name, kernels


def summarize(kernels: list, steps: int, step_ms: float, top: int) -> dict:
    """Per-step totals of `device_kernels`' list over `steps` steps of median `step_ms`."""
    ms = collections.Counter()
    count = collections.Counter()
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for name, ns in kernels:
        kind = kernel_kind(name)
        ms[kind] += ns / 1e6
        count[kind] += 1
        key = re.sub(r"[_.]\d+$", "", name)[:120]  # fusion_3, fusion_7 -> fusion
        by_name[key][0] += 1
        by_name[key][1] += ns / 1e6
    busy = sum(ms.values()) / steps
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "busy_ms_per_step": round(busy, 3),
        "idle_ms_per_step": round(step_ms - busy, 3),
        "kernels_per_step": round(sum(count.values()) / steps, 1),
        "ms_per_step": {k: round(ms[k] / steps, 3) for k in KINDS},
        "kernels_per_step_by_kind": {k: round(count[k] / steps, 1) for k in KINDS},
        "top_kernels": [
            {"name": name, "kind": kernel_kind(name), "calls_per_step": round(n / steps, 1),
             "ms_per_step": round(total / steps, 3)}
            for name, (n, total) in ranked
        ],
    }


def profile_one(model_name: str, policy: str, steps: int, warmup: int, top: int) -> dict:
    """Profiles one configuration in this process; returns its JSON record."""
    import jax
    import keras

    from keras_mp.cli import measure
    from keras_mp.cli.workloads import WORKLOADS

    measure._names("model", model_name, WORKLOADS)
    measure._names("policy", policy, measure.POLICIES)
    base, _, suffix = policy.partition("@")
    if suffix == "nojit":
        raise ValueError("jax_profile.py profiles XLA steps; drop @nojit.")
    workload = WORKLOADS[model_name]
    strict = measure._strict_fp32("jax") if base == "float32_strict" else contextlib.nullcontext()
    times = []
    # JAX reads the matmul precision when it traces a step: every step inside `strict`.
    with strict, tempfile.TemporaryDirectory() as logdir:
        model, x, y = measure.model_and_batch(workload, base, True)
        for _ in range(1 + warmup):
            model.train_on_batch(x, y)
        with jax.profiler.trace(logdir):
            for _ in range(steps):
                start = time.perf_counter()
                model.train_on_batch(x, y)  # returns a host float: synchronous
                times.append(time.perf_counter() - start)
        (path,) = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        plane, kernels = device_kernels(jax.profiler.ProfileData.from_file(path))
    step_ms = statistics.median(times) * 1e3
    return {
        "model": model_name,
        "policy": base,
        "xla_remat": suffix == "remat",
        "device": jax.devices()[0].device_kind,
        "plane": plane,
        "steps": steps,
        "step_ms_median": round(step_ms, 3),
        **summarize(kernels, steps, step_ms, top),
        "jax": jax.__version__,
        "keras": keras.__version__,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt")
    parser.add_argument("--policies", default="stock_mixed_bfloat16,keras_mp_mixed_bfloat16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        record = profile_one(args.models, args.policies, args.steps, args.warmup, args.top)
        print("RESULT " + json.dumps(record), flush=True)
        return 0
    from keras_mp.cli.measure import each_in_own_process

    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--top", str(args.top)]
    return each_in_own_process(__file__, args.models, args.policies, extra, "jax", args.out)


if __name__ == "__main__":
    sys.exit(main())
