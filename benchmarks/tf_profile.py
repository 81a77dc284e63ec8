"""Where a TensorFlow train step spends its time and memory, from TF's own profiler.

Host RSS (what `keras_mp.cli.benchmark` reports on CPUs) mixes tensors with libraries, graphs
and memory the C allocator keeps; this script reads TensorFlow's allocator instead: it runs
a workload's train steps under `tf.profiler`, then prints one JSON line per configuration
with the median step time, the allocator's peak bytes in use during the profiled steps
(tensors only), host RSS, and the op types that took the most time (summed over TF's
threads, per step). Each configuration runs in its own process, like the harness.

    python benchmarks/tf_profile.py --models cpu_gpt \
        --policies stock_mixed_bfloat16@nojit,keras_mp_mixed_bfloat16@nojit
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
MIB = 2**20
_XLA_CLUSTER = "XLA cluster (async op)"


def _op_type(event_name: str) -> str | None:
    """The op type a TF executor event is counted under, None for events inside others.

    TF ops are `name:Type`. The executor's own events around them (`ExecutorState::Process`,
    `ThreadpoolListener::...`, `ExecutorDoneCallback`) are not ops. An XLA cluster called from
    the TF graph (keras_mp's `jit_compile=True` kernels) runs as an async op,
    `ExecutorState::ProcessAsync::Start`; the XLA events inside it (`CpuExecutable::...`,
    `ThunkExecutor::...`, fusions, which have no `:`) are part of that time and are not
    counted again.
    """
    if event_name == "ExecutorState::ProcessAsync::Start":
        return _XLA_CLUSTER
    if "::" in event_name or ":" not in event_name:
        return None
    op = event_name.rpartition(":")[2]  # (XLA's "end: fusion" markers: not an identifier)
    return op if op.isidentifier() else None


def _read_trace(logdir: str, steps: int):
    """(peak allocator bytes per allocator, {op type: (ms per step, count per step)})."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    peaks, times, counts = collections.Counter(), collections.Counter(), collections.Counter()
    for plane in space.planes:
        names, stat_names = plane.event_metadata, plane.stat_metadata
        for line in plane.lines:
            for event in line.events:
                name = names[event.metadata_id].name
                if name == "MemoryAllocation" or name == "MemoryDeallocation":
                    stats = {stat_names[s.metadata_id].name: s for s in event.stats}
                    allocator = stats["allocator_name"]
                    allocator = (
                        stat_names[allocator.ref_value].name
                        if allocator.ref_value
                        else allocator.str_value
                    )
                    in_use = stats["bytes_allocated"].int64_value
                    peaks[allocator] = max(peaks[allocator], in_use)
                elif line.name.startswith("tf_Compute"):
                    op = _op_type(name)
                    if op is not None:
                        times[op] += event.duration_ps / 1e9 / steps
                        counts[op] += 1 / steps
    ops = {op: (round(ms, 2), round(counts[op])) for op, ms in times.most_common()}
    return dict(peaks), ops


def profile_one(
    model_name: str, policy: str, steps: int, warmup: int, batch: int, top: int
) -> dict:
    """Profiles one configuration in this process; returns its JSON record."""
    import tensorflow as tf

    from keras_mp.cli import measure
    from keras_mp.cli.workloads import WORKLOADS

    policy, _, suffix = policy.partition("@")
    workload = WORKLOADS[model_name]
    if batch:
        workload = dataclasses.replace(workload, batch=batch)
    jit = measure._JIT_SUFFIX.get(suffix, measure.default_jit(policy, "tensorflow", False))
    model, x, y = measure.model_and_batch(workload, policy, jit)
    for _ in range(1 + warmup):
        model.train_on_batch(x, y)
    times = []
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        for _ in range(steps):
            start = time.perf_counter()
            model.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
        tf.profiler.experimental.stop()
        peaks, ops = _read_trace(logdir, steps)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / MIB
    return {
        "model": model_name,
        "policy": policy,
        "jit_compile": jit,
        "batch": workload.batch,
        "step_ms_median": round(statistics.median(times) * 1e3, 1),
        "tensor_peak_mib": {k: round(v / MIB, 1) for k, v in peaks.items()},
        "host_rss_peak_gib": round(rss, 3),
        "top_ops_ms_per_step": dict(list(ops.items())[:top]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cpu_gpt")
    parser.add_argument(
        "--policies", default="stock_mixed_bfloat16@nojit,keras_mp_mixed_bfloat16@nojit"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=0, help="override the workload's batch")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        record = profile_one(
            args.models, args.policies, args.steps, args.warmup, args.batch, args.top
        )
        print("RESULT " + json.dumps(record), flush=True)
        return 0
    from keras_mp.cli.measure import each_in_own_process

    extra = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch",
             str(args.batch), "--top", str(args.top)]
    return each_in_own_process(__file__, args.models, args.policies, extra, "tensorflow")


if __name__ == "__main__":
    sys.exit(main())
