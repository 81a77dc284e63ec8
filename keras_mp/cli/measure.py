"""Measuring one benchmark configuration: a workload trained under one precision policy.

`run_one` builds the workload's model under the policy's recipe (stock Keras or keras_mp),
times its train steps and returns the JSON record of `keras_mp.cli.benchmark`. The policies:

- `float32`: FP32 (TF32 allowed for matmuls/convolutions on Ampere+ GPUs).
- `float32_strict`: FP32 with TF32 off (`kmp.hardware.set_tf32(False)`).
- `stock_mixed_bfloat16`, `stock_mixed_float16`: Keras' global dtype policy, Keras' loss and
  (FP16) `keras.optimizers.LossScaleOptimizer`: what a user gets from Keras alone.
- `keras_mp_mixed_bfloat16`, `keras_mp_mixed_float16`: `kmp.convert(model, kmp.Policy(...))`
  (FP32 keep-list), `kmp.losses.SparseCategoricalCrossentropy(from_logits=True)` and, for
  FP16, `kmp.LossScaleOptimizer` (dynamic scaling).
- `keras_mp_float32`: the FP32 model (nothing converted) with keras_mp's loss: the part of
  keras_mp's speed that does not come from precision, so that `speedup_vs_best_fp32`
  compares precisions, not kernels.
- `stock_mixed_float16_kmp_scaler`: `stock_mixed_float16` with `kmp.LossScaleOptimizer` in
  place of Keras' (same model, loss and policy): its `speedup_vs_stock` is the cost of
  keras_mp's loss scaler alone.
- `keras_mp_float8`: `kmp.convert(model, kmp.Policy("float8"))`: FP8 Dense/EinsumDense
  (delayed scaling) over mixed_bfloat16; its `speedup_vs_stock` is against stock bf16.
- `keras_mp_lean_bfloat16`: `kmp.convert(model, kmp.Policy("lean_bfloat16"))`, compiled
  with AdamW (which becomes `kmp.LeanOptimizer`): bfloat16 weights rounded
  stochastically and 4-bit moments (the defaults since 2026-12-03; kahan + int8 before);
  its `speedup_vs_stock` is against stock bf16.

Example:

```python
from keras_mp.cli.measure import run_one

run_one("tiny_gpt", "keras_mp_mixed_bfloat16", steps=5)["step_ms_median"]
```
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

from keras_mp.cli.device_probe import (
    backend_version,
    device_and_memory,
    on_gpu,
    tf_cpu_tensor_peak,
)
from keras_mp.cli.workloads import WORKLOADS

__all__ = [
    "POLICIES",
    "REMAT_XLA_FLAG",
    "config_env",
    "default_jit",
    "each_in_own_process",
    "model_and_batch",
    "run_one",
]


# Policy name -> Keras dtype policy. Order = run order, and priority when a --budget cuts a
# run short: each row's references (float32, the stock row of its dtype) are measured
# before it; float32_strict (slow on GPUs) comes last.
POLICIES = {
    "float32": "float32",
    "keras_mp_float32": "float32",  # the FP32 model with keras_mp's loss
    "stock_mixed_bfloat16": "mixed_bfloat16",
    "keras_mp_mixed_bfloat16": "mixed_bfloat16",
    "stock_mixed_float16": "mixed_float16",
    "keras_mp_mixed_float16": "mixed_float16",
    "stock_mixed_float16_kmp_scaler": "mixed_float16",  # the loss scaler's overhead alone
    "keras_mp_float8": "float8",  # FP8 matmuls over mixed_bfloat16: compared with stock bf16
    # bf16 weights, 4-bit moments, stochastic rounding (kmp.LeanOptimizer): vs stock bf16
    "keras_mp_lean_bfloat16": "lean_bfloat16",
    "float32_strict": "float32",
}
# A policy suffix -> jit_compile of that row. `@remat`: XLA, with XLA's rematerialization
# pass given a memory limit (`REMAT_XLA_FLAG`, set in the row's subprocess before its backend
# starts): on a GPU, XLA then recomputes cheap element-wise tensors in the backward pass
# (layer-norm outputs, low-precision copies of the weights) instead of keeping them from the
# forward pass. The limit is a share of the GPU's memory (5%, sized for the `gpt` workload
# on an H200); a CPU ignores it.
_JIT_SUFFIX = {"jit": True, "nojit": False, "remat": True}
REMAT_XLA_FLAG = "--xla_gpu_memory_limit_slop_factor=5"
_ENV_KEYS = (
    "TF_ENABLE_ONEDNN_OPTS",
    "OMP_NUM_THREADS",
    "XLA_FLAGS",
    "TF_XLA_FLAGS",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "ONEDNN_MAX_CPU_ISA",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "KERAS_MP_LEAN_KERNEL",
)


def _names(kind: str, text: str, valid) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        base = name.split("@")[0]
        suffix = name.partition("@")[2]
        if base not in valid or (suffix and suffix not in _JIT_SUFFIX):
            extra = " (optionally with @jit, @nojit or @remat)" if kind == "policy" else ""
            raise ValueError(
                f"Unknown {kind} {name!r}. Valid {kind} names{extra}: {', '.join(valid)}."
            )
    if not names:
        raise ValueError(f"No {kind} given. Valid {kind} names: {', '.join(valid)}.")
    return names


def config_env(policy: str, environ) -> dict:
    """The environment of the process that runs `policy`: a copy of `environ`, with
    `REMAT_XLA_FLAG` added to its `XLA_FLAGS` for a `@remat` policy."""
    flags = environ.get("XLA_FLAGS", "")
    if policy.partition("@")[2] != "remat" or REMAT_XLA_FLAG in flags.split():
        return dict(environ)
    return {**environ, "XLA_FLAGS": f"{flags} {REMAT_XLA_FLAG}".strip()}


def default_jit(policy: str, backend: str, on_gpu: bool) -> bool:
    """`jit_compile` when neither `--jit` nor `--no-jit` nor a suffix is given.

    XLA everywhere except TensorFlow on CPU, where oneDNN's kernels (AVX512-BF16/AMX) beat
    XLA:CPU; float16 stays on XLA there (TF's non-XLA CPU float16 kernels are very slow).
    """
    if backend != "tensorflow" or on_gpu:
        return True
    return POLICIES[policy] == "mixed_float16"


def _keras_mp_api():
    """The keras_mp names the harness uses; a clear error if one is missing."""
    import importlib

    import keras_mp as kmp

    needed = {
        "keras_mp": ("convert", "Policy", "LossScaleOptimizer", "DEFAULT_KEEP_FP32"),
        "keras_mp.losses": ("SparseCategoricalCrossentropy",),
    }
    missing = [
        f"{mod}.{n}"
        for mod, names in needed.items()
        for n in names
        if not hasattr(importlib.import_module(mod), n)
    ]
    if missing:
        raise RuntimeError(f"keras_mp is missing {missing}: cannot run keras_mp policies.")
    return kmp, importlib.import_module("keras_mp.losses")


@contextlib.contextmanager
def _strict_fp32(backend: str):
    """TF32 off (`kmp.hardware.set_tf32(False)`) inside, the backend's setting restored after."""
    import keras_mp.hardware as hardware

    if backend == "jax":
        import jax

        previous = jax.config.jax_default_matmul_precision
        restore = lambda: jax.config.update("jax_default_matmul_precision", previous)
    else:
        previous = hardware.tf32_enabled(backend)
        restore = lambda: previous is None or hardware.set_tf32(previous)
    hardware.set_tf32(False)
    try:
        yield
    finally:
        restore()


def _compiled_model(workload, policy: str, jit_compile: bool, keep_fp32, steps_per_execution=1):
    import keras

    dtype = POLICIES[policy]
    keras.utils.set_random_seed(0)
    stock = not policy.startswith("keras_mp_")
    keras.config.set_dtype_policy(dtype if stock else "float32")
    model = workload.build(keras)
    optimizer = keras.optimizers.AdamW(1e-4)
    if stock:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        if policy == "stock_mixed_float16_kmp_scaler":
            optimizer = _keras_mp_api()[0].LossScaleOptimizer(optimizer)
        elif dtype == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    else:
        kmp, kmp_losses = _keras_mp_api()
        if dtype != "float32":
            keep = kmp.DEFAULT_KEEP_FP32 if keep_fp32 is None else keep_fp32
            # check=None: the workloads are known to run, and a compile-only target
            # (xla_memory.py --target h200) cannot run them on this machine
            model = kmp.convert(model, kmp.Policy(dtype, keep_fp32=keep), check=None)
        loss = kmp_losses.SparseCategoricalCrossentropy(from_logits=True)
        if dtype == "mixed_float16":
            optimizer = kmp.LossScaleOptimizer(optimizer)
    model.compile(
        optimizer=optimizer,
        loss=loss,
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
        # A stock row is Keras as it is without keras_mp: importing keras_mp gives Keras'
        # own mixed_bfloat16 the skip-only scaler (keras_mp.scaling.autoscale), which this turns
        # off. Keras itself reads the flag only to wrap float16, done above by hand.
        auto_scale_loss=not stock,
    )
    return model


def remat_scope(workload, prefixes=()):
    """A `keras.RematScope(mode="list_of_layers")` naming each block's layers that start
    with one of `prefixes` (e.g. `("attn_", "ffn_in_")`: the GPT's attention layers and its
    first FFN Dense; `"attn_[0-2]"`: those of blocks 0 to 2 only), or a null context for
    none. The model must be built inside it: a layer takes its RematScope when it is made."""
    import keras

    if not prefixes:
        return contextlib.nullcontext()
    names = []
    for entry in prefixes:  # "attn_" (every block) or "attn_[0-2]" (blocks 0 to 2)
        prefix, _, span = entry.partition("[")
        first, _, last = span.rstrip("]").partition("-")
        blocks = range(getattr(workload, "layers", 0))
        if span:
            blocks = range(int(first), int(last or first) + 1)
        names += [f"{prefix}{i}" for i in blocks]
    return keras.RematScope(mode="list_of_layers", layer_names=names)


def model_and_batch(workload, policy: str, jit_compile: bool, keep_fp32=None):
    """A workload's compiled model under a harness policy (no suffix), with Keras' global
    dtype policy restored after, and its batch as backend tensors: `(model, x, y)`."""
    import keras
    import numpy as np

    previous = keras.config.dtype_policy()
    try:
        model = _compiled_model(workload, policy, jit_compile, keep_fp32)
    finally:
        keras.config.set_dtype_policy(previous)
    x, y = (keras.ops.convert_to_tensor(a) for a in workload.data(np.random.default_rng(0)))
    return model, x, y


def each_in_own_process(
    script: str, models: str, policies: str, extra: list, backend: str, out=None
) -> int:
    """Runs `script --one --models M --policies P *extra` once per configuration, each in
    its own process (environment: `config_env`), prints the JSON record each prints
    after `RESULT ` (an error record with its stderr's end if none) and appends it to the
    file `out`. Returns 1 if a configuration failed, else 0."""
    status = 0
    for model in models.split(","):
        for policy in policies.split(","):
            cmd = [sys.executable, script, "--one", "--models", model, "--policies", policy]
            env = config_env(policy, dict(os.environ, KERAS_BACKEND=backend))
            done = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env)
            lines = [line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if not lines:
                status = 1
                lines = [
                    json.dumps({"model": model, "policy": policy, "error": done.stderr[-800:]})
                ]
            print(lines[0], flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(lines[0] + "\n")
    return status


def run_one(
    model_name: str,
    policy: str,
    steps: int = 20,
    warmup: int = 3,
    jit_compile: bool | None = None,
    keep_fp32=None,
    intra_op: int = 0,
    inter_op: int = 0,
    remat_layers=(),
    recompute: bool = False,
) -> dict:
    """Measures one configuration in this process and returns its JSON record.

    Args:
        model_name: a key of `WORKLOADS`.
        policy: a key of `POLICIES` (with an optional `@jit` / `@nojit` / `@remat` suffix;
            `@remat` needs `REMAT_XLA_FLAG` in this process's `XLA_FLAGS`: `config_env`).
        steps: timed train steps (each `train_on_batch` returns a host float: synchronous).
        warmup: untimed steps after the first, compiling one.
        jit_compile: XLA on/off; `None` takes the suffix, else `default_jit`.
        keep_fp32: keep-list for keras_mp policies; `None` means `kmp.DEFAULT_KEEP_FP32`.
        intra_op / inter_op: TensorFlow thread-pool sizes (0: TensorFlow's default).
        remat_layers: layer-name prefixes built under Keras' `RematScope` (`remat_scope`):
            those layers' activations are recomputed in the backward pass, not kept.
        recompute: `kmp.recompute_elementwise` (JAX): matmul and attention outputs kept,
            the element-wise work recomputed.

    Returns:
        A dict: model, policy, backend, device, jit_compile, compile_s, step_ms_median,
        step_ms_min, units, units_per_s, tflops, peak_mem_gib, peak_mem_kind, loss, ...;
        on TensorFlow/CPU also tensor_peak_mib (TF's allocator, over the timed steps).
    """
    _names("model", model_name, WORKLOADS)
    _names("policy", policy, POLICIES)
    policy, _, suffix = policy.partition("@")
    if suffix == "remat" and REMAT_XLA_FLAG not in os.environ.get("XLA_FLAGS", "").split():
        raise ValueError(
            f"A @remat row needs XLA_FLAGS={REMAT_XLA_FLAG} set before the backend starts; "
            "the harness sets it in the row's own process (not with --in-process). "
            f"XLA_FLAGS here: {os.environ.get('XLA_FLAGS', '')!r}"
        )
    import keras
    import numpy as np

    backend = keras.backend.backend()
    if remat_layers and backend == "tensorflow":
        raise ValueError(
            f"remat_layers {list(remat_layers)}: Keras' RematScope fails in TensorFlow's "
            "compiled step (tf.custom_gradient takes no keyword arguments outside eager "
            "execution, and Keras calls layers with `training=`); measure it on JAX."
        )
    if backend == "tensorflow" and (intra_op or inter_op):
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(intra_op)
        tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    if suffix:
        jit_compile = _JIT_SUFFIX[suffix]
    elif jit_compile is None:
        jit_compile = default_jit(policy, backend, on_gpu(backend))
    workload = WORKLOADS[model_name]
    strict = _strict_fp32(backend) if policy == "float32_strict" else contextlib.nullcontext()
    with strict:  # JAX reads the matmul precision when it traces the first step
        with remat_scope(workload, remat_layers):
            model, x, y = model_and_batch(workload, policy, jit_compile, keep_fp32)
        if recompute:
            from keras_mp.memory.recompute import recompute_elementwise

            recompute_elementwise(model)  # a clear error on TensorFlow
        start = time.perf_counter()
        model.train_on_batch(x, y)
        compile_s = time.perf_counter() - start
        for _ in range(warmup):
            model.train_on_batch(x, y)
        tensor_peak = tf_cpu_tensor_peak(backend, reset=True)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            loss = model.train_on_batch(x, y)
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    tensor_peak = tf_cpu_tensor_peak(backend) if tensor_peak is not None else None
    device, peak, peak_kind = device_and_memory(backend)
    record = {
        "model": model_name,
        "policy": policy,
        "backend": backend,
        "device": device,
        "jit_compile": bool(jit_compile),
        "xla_remat": suffix == "remat",
        "remat_layers": list(remat_layers) or None,
        "recompute_elementwise": recompute,
        "compile_s": round(compile_s, 2),
        "step_ms_median": round(median * 1e3, 3),
        "step_ms_min": round(min(times) * 1e3, 3),
        "units": workload.unit,
        "units_per_s": round(workload.units_per_step / median, 1),
        "tflops": round(workload.flops_per_step(model) / median / 1e12, 4),
        "peak_mem_gib": round(peak, 3),
        "peak_mem_kind": peak_kind,
        "loss": float(np.asarray(loss).reshape(-1)[0]),
        "params": int(model.count_params()),
        "optimizer": type(model.optimizer).__name__,
        "state_bytes_per_parameter": round(_state_bytes(model), 3),
        "steps": steps,
        "warmup": warmup,
        "keras": keras.__version__,
        "backend_version": backend_version(backend),
        "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
    }
    if tensor_peak is not None:
        record["tensor_peak_mib"] = round(tensor_peak / 2**20, 1)
    if intra_op or inter_op:
        record["threads"] = {"intra_op": intra_op, "inter_op": inter_op}
    if policy.startswith("keras_mp_") and POLICIES[policy] != "float32":
        record["keep_fp32"] = "default" if keep_fp32 is None else list(keep_fp32)
    scale = getattr(model.optimizer, "dynamic_scale", None)
    if scale is not None:
        record["loss_scale"] = float(keras.ops.convert_to_numpy(scale))
    return record


def _state_bytes(model) -> float:
    from keras_mp.lean.memory import state_bytes

    return state_bytes(model).per_parameter
