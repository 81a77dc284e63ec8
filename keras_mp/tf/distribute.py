"""tf.distribute helpers: what XLA allows under a strategy, and local multi-worker runs.

`LossScaleOptimizer` works under `tf.distribute.MirroredStrategy` and
`tf.distribute.MultiWorkerMirroredStrategy` (in `model.fit` and in custom loops): it
all-reduces the per-variable finiteness flags before deciding, so every replica skips
the same steps and the scale and counters stay identical everywhere. Two things in
TensorFlow 2.21 are outside its control, and this module makes them explicit:

- XLA (`jit_compile=True`) under a strategy with more than one replica works only on
  GPUs, with just the per-replica step compiled (`strategy.run(tf.function(step,
  jit_compile=True), ...)`). `model.fit(jit_compile=True)` compiles the whole
  `strategy.run`, which cannot reach the other devices' variables; on other devices
  TensorFlow itself lifts a compiled per-replica step around the whole run, and has no
  XLA kernel for cross-worker collectives. `check_jit_compile` (run by the optimizer
  when its step is traced) raises `UnsupportedJitCompileError` for those cases instead
  of letting TensorFlow fail at run time, possibly after writing garbage into the
  variables.
- Multi-worker training on one machine needs one process per worker, each with its own
  `TF_CONFIG`: `local_tf_configs` and `launch_local_workers` do that on 127.0.0.1.

Note: Keras 3.15's `model.fit` fails under `MultiWorkerMirroredStrategy` before the first
step (keras-team/keras#20585); use a custom training loop there (see
`examples/multi_device.py`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "UnsupportedJitCompileError",
    "WorkerResult",
    "check_jit_compile",
    "launch_local_workers",
    "local_tf_configs",
    "widen_collective_broadcasts",
]

# Dtypes TensorFlow's collective broadcast refuses, and the wider dtype that holds each
# exactly (a cast there and back loses nothing).
_WIDER = {
    "bfloat16": "float32",
    "uint8": "int32",
    "int8": "int32",
    "int16": "int32",
    "uint16": "int32",
}


class UnsupportedJitCompileError(ValueError):
    """`jit_compile=True` was asked for under a strategy where TensorFlow cannot run it."""

    # AutoGraph re-raises an error from traced code with its own type only if it can
    # rebuild it from the message (else it becomes a StagingError); this tells it so.
    __init__ = Exception.__init__


def _in_xla(graph) -> bool:
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(graph)


def check_jit_compile(strategy: Any = None) -> None:
    """Raises if the function being traced is XLA-compiled in a way `strategy` cannot run.

    Call it while tracing a replica step (the `LossScaleOptimizer` does, in `apply`).
    Outside XLA, with a single replica in sync, or under a strategy other than
    `MirroredStrategy` / `MultiWorkerMirroredStrategy` it does nothing. Otherwise it
    raises `UnsupportedJitCompileError` when

    - the whole `strategy.run` is compiled over more than one local device (as
      `model.fit` does with `jit_compile=True`, and as TensorFlow does for a compiled
      per-replica step on non-GPU devices): one compiled function cannot reach the other
      devices' variables (keras-team/keras#19005), or
    - a replica device is not a GPU (TensorFlow has no XLA kernel for collectives on CPU
      devices).

    Args:
        strategy: the `tf.distribute.Strategy`; default: the current one.

    Raises:
        UnsupportedJitCompileError: naming the strategy, its devices and what to do.

    Example:

    >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # doctest: +SKIP
    >>> with strategy.scope():  # doctest: +SKIP
    ...     model.compile(optimizer=kmp.LossScaleOptimizer(opt), jit_compile=True)
    >>> model.fit(x, y)  # doctest: +SKIP
    UnsupportedJitCompileError: jit_compile=True is not supported under MirroredStrategy ...
    """
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    mirrored = (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy)
    if (
        not isinstance(strategy, mirrored)  # e.g. TPUStrategy: always compiled, and fine
        or strategy.num_replicas_in_sync < 2
        or not _in_xla(tf.compat.v1.get_default_graph())
    ):
        return
    devices = list(strategy.extended.worker_devices)
    kinds = {tf.DeviceSpec.from_string(d).device_type for d in devices}
    # A MirroredStrategy replica thread records the graph that called `strategy.run`. The
    # whole run is compiled if that graph was already compiled when it called the step;
    # calling a compiled per-replica step marks that graph too, but not its parents.
    caller = getattr(threading.current_thread(), "graph", None)
    whole_run = isinstance(caller, tf.Graph) and len(devices) > 1
    if whole_run:
        current = tf.compat.v1.get_default_graph()
        outer = getattr(caller, "outer_graph", None)
        whole_run = (current is caller and _in_xla(caller)) or (
            outer is not None and _in_xla(outer)
        )
    if kinds <= {"GPU"} and not whole_run:
        return
    why = (
        "the whole `strategy.run` is compiled (as `model.fit` does with jit_compile=True), "
        "and one compiled function cannot reach the variables on the other devices"
        if whole_run
        else f"TensorFlow has no XLA cross-replica reduction on {sorted(kinds - {'GPU'})} devices"
    )
    raise UnsupportedJitCompileError(
        f"jit_compile=True is not supported under {type(strategy).__name__} with "
        f"{strategy.num_replicas_in_sync} replicas (local devices {devices}): {why}. "
        "Compile with jit_compile=False under this strategy (model.compile(..., "
        "jit_compile=False), or a plain tf.function in a custom loop); on GPUs, a custom "
        "loop may compile only the per-replica step: "
        "strategy.run(tf.function(step, jit_compile=True), args=...)."
    )


def widen_collective_broadcasts() -> None:
    """Lets `MultiWorkerMirroredStrategy` create bfloat16, int8 and uint8 variables.

    Under that strategy every variable's initial value is broadcast from the chief worker
    with TensorFlow's collective broadcast, which takes no bfloat16, int8 or uint8 (2.21:
    "Value for attr 'T' of bfloat16 is not in the list of allowed values"): a
    `"lean_bfloat16"` model (bfloat16 weights, uint8 moment codes) and Keras' own
    `"bfloat16"` policy fail before the first step. This wraps the broadcast so that such
    values travel as float32 / int32 and are cast back: exact, and only for the dtypes
    TensorFlow refuses (others are untouched). `import keras_mp` calls it on the
    TensorFlow backend; calling it again does nothing.
    """
    import tensorflow as tf
    from tensorflow.python.ops import collective_ops

    if getattr(collective_ops.broadcast_send, "_keras_mp_widened", False):
        return
    send, recv = collective_ops.broadcast_send, collective_ops.broadcast_recv

    def wider(dtype):
        return _WIDER.get(tf.as_dtype(dtype).name)

    def broadcast_send(t, shape, dtype, *args, **kwargs):
        wide = wider(dtype)
        if wide is None:
            return send(t, shape, dtype, *args, **kwargs)
        return send(tf.cast(t, wide), shape, wide, *args, **kwargs)

    def broadcast_recv(shape, dtype, *args, **kwargs):
        wide = wider(dtype)
        if wide is None:
            return recv(shape, dtype, *args, **kwargs)
        return tf.cast(recv(shape, wide, *args, **kwargs), dtype)

    for fn in (broadcast_send, broadcast_recv):
        fn._keras_mp_widened = True
    collective_ops.broadcast_send, collective_ops.broadcast_recv = broadcast_send, broadcast_recv


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def local_tf_configs(num_workers: int, ports: Sequence[int] | None = None) -> list[str]:
    """`TF_CONFIG` values for `num_workers` workers on 127.0.0.1.

    Args:
        num_workers: number of workers (>= 1).
        ports: one port per worker; default: free ports picked by the OS.

    Returns:
        One JSON string per worker, index `i` for worker `i`.

    Example:

    >>> json.loads(local_tf_configs(2, ports=[2222, 2223])[1])["task"]
    {'type': 'worker', 'index': 1}
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be a positive integer, got {num_workers!r}.")
    ports = list(ports) if ports is not None else _free_ports(num_workers)
    if len(ports) != num_workers:
        raise ValueError(
            f"`ports` must have one port per worker ({num_workers}), got {len(ports)}."
        )
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    return [
        json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        for i in range(num_workers)
    ]


class WorkerResult(NamedTuple):
    """What one worker process left: its index, exit status, stdout and stderr."""

    index: int
    returncode: int
    stdout: str
    stderr: str


def launch_local_workers(
    argv: Sequence[str],
    num_workers: int = 2,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[WorkerResult]:
    """Runs `num_workers` copies of a program as one multi-worker cluster on this machine.

    Each process gets its own `TF_CONFIG` (free ports on 127.0.0.1) and
    `KERAS_MP_WORKER_INDEX`. If any worker fails, or the time runs out, every worker still
    running is killed (a worker left alone would wait forever in a collective) and a
    `RuntimeError` reports each worker's status and the end of its stdout and stderr.

    Args:
        argv: the command, e.g. `[sys.executable, "train.py"]`.
        num_workers: number of workers.
        timeout: seconds for the whole cluster.
        env: environment for the workers; default: this process's.

    Returns:
        One `WorkerResult` per worker, in index order, all with return code 0.

    Raises:
        RuntimeError: a worker failed or the cluster ran out of time.

    Example:

    >>> results = launch_local_workers(["python", "train.py"])  # doctest: +SKIP
    >>> print(results[0].stdout)  # doctest: +SKIP
    """
    import tempfile
    import time

    from keras_mp.keras_glue.extras import require

    require("tensorflow", "launch_local_workers (tf.distribute.MultiWorkerMirroredStrategy)")
    configs = local_tf_configs(num_workers)
    base = dict(os.environ if env is None else env)
    procs, logs = [], []
    try:
        for i, config in enumerate(configs):
            # Files, not pipes: a worker never blocks on a full pipe nobody reads yet.
            out, err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
            logs.append((out, err))
            worker_env = dict(base, TF_CONFIG=config, KERAS_MP_WORKER_INDEX=str(i))
            procs.append(subprocess.Popen(list(argv), env=worker_env, stdout=out, stderr=err))
        deadline = time.monotonic() + timeout
        failed, timed_out = False, False
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                failed = True
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
        failed = failed or any(p.returncode != 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    texts = []
    for files in logs:
        texts.append([])
        for f in files:
            f.seek(0)
            texts[-1].append(f.read())
            f.close()
    results = [WorkerResult(i, p.returncode, *t) for i, (p, t) in enumerate(zip(procs, texts))]
    if failed or timed_out:
        what = f"timed out after {timeout:g} s" if timed_out else "failed"
        detail = "\n".join(
            f"--- worker {r.index} (exit status {r.returncode}), end of stdout:\n"
            f"{r.stdout[-1000:]}\n--- end of stderr:\n{r.stderr[-3000:]}"
            for r in results
        )
        raise RuntimeError(f"launch_local_workers: the cluster {what}.\n{detail}")
    return results
