"""`keras-mp compare`: one model trained under every precision mode, side by side.

Each mode starts from the same float32 weights (the model is built once with the seed and
converted with `kmp.convert`), sees the batches in the same order and follows the same
learning-rate schedule. Mixed modes use `kmp.Policy` with its FP32 keep-list (the logits
layer stays float32, batch norm keeps float32 statistics) and FP32 master weights;
`mixed_float16` adds `kmp.LossScaleOptimizer`. The pure modes keep every variable in
float16/bfloat16 with no keep-list, no master weights and no loss scaling: what training
looks like without the recipe. Losses are `kmp.losses` (float32 math) in every mode.

The default schedule (Adam, peak learning rate 3e-4 with cosine decay to 0, 20 epochs,
batch 32) makes Adam's per-weight steps (about the learning rate) fall, late in training,
below half a float16 ulp of most weights (2**-11 of the weight's magnitude): pure float16
stops moving while float32 master weights keep learning. The "frozen" column measures it
directly: the fraction of weights an epoch left bit-identical. With SGD or a larger
learning rate the effect is weaker or absent; the table shows whatever happens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
import warnings
from typing import Any

import keras
import numpy as np

import keras_mp as kmp
import keras_mp.numerics.losses as kmp_losses
from keras_mp.cli.data import Dataset, build_model, load_dataset
from keras_mp.cli.records import EpochRecorder, peak_memory, reset_peak_memory
from keras_mp.cli.settings import CALIBRATED, DEFAULT_POLICIES, CompareConfig, lean_variant
from keras_mp.observe import callbacks as kmp_callbacks

__all__ = [
    "DEFAULT_POLICIES",
    "THRESHOLDS",
    "CompareConfig",
    "is_lean",
    "run_compare",
    "run_policy",
    "verdict",
]

LABELS = {
    "float32": "float32",
    "mixed_float16": "mixed float16",
    "mixed_bfloat16": "mixed bfloat16",
    "float16": "pure float16",
    "bfloat16": "pure bfloat16",
    CALIBRATED: "mixed float16, calibrated",
    "lean_bfloat16": "lean bfloat16",
}
# Batches of the training set the calibrated mode measures (kmp.convert(..., calibrate=)).
CALIBRATION_SAMPLES = 256

THRESHOLDS = {
    # |val acc - FP32 val acc| at most this: "matches FP32" (0.01 = 4 of 397 digits).
    "match_accuracy": 0.01,
    # lower than FP32 and at least this fraction of the weights unchanged over the last
    # epoch (their updates rounded away): "stalled"; lower otherwise: "lower". Not for
    # the lean state: its roundings are unbiased (stochastic, or kept in a compensation
    # buffer), so a weight whose bits did not change in an epoch has lost no update.
    "stalled_frozen_fraction": 0.5,
    # a non-finite loss, or a final train loss above this multiple of the first
    # epoch's: "diverged".
    "diverged_loss_growth": 1.5,
}


@contextlib.contextmanager
def _pure_modes_expected():
    """Hides a pure policy's "no FP32 master weights" warning: the comparison runs those
    modes on purpose (the warning also comes when `kmp.convert` rebuilds the policy)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Policy '(b)?float16' keeps variables", category=UserWarning
        )
        yield


def _policy(name: str) -> kmp.Policy:
    """Mixed modes keep kmp's FP32 keep-list; pure modes are all-low-precision."""
    name = name.split(":")[0]  # lean_bfloat16:ROUNDING:MOMENTS
    with _pure_modes_expected():
        if name in ("float16", "bfloat16"):
            return kmp.Policy(name, keep_fp32=())
        return kmp.Policy("mixed_float16" if name == CALIBRATED else name)


def _label(policy: str) -> str:
    variant = lean_variant(policy)
    return f"lean bfloat16 {variant[0]}+{variant[1]}" if variant else LABELS[policy]


def _jit(policy: str, jit: str) -> tuple[Any, str]:
    """The `jit_compile` argument for `policy` and its label for the table."""
    if jit == "on" or (jit == "auto" and "float16" in policy and "bfloat16" not in policy):
        return True, "xla"
    if jit == "off":
        return False, "none"
    return "auto", "default"


def _optimizer(cfg: CompareConfig, total_steps: int) -> keras.optimizers.Optimizer:
    lr = cfg.lr
    if cfg.schedule == "cosine":
        lr = keras.optimizers.schedules.CosineDecay(cfg.lr, decay_steps=total_steps)
    if cfg.optimizer == "sgd":
        return keras.optimizers.SGD(lr, momentum=0.9)
    return keras.optimizers.Adam(lr)


def run_policy(
    policy: str, base: keras.Model, data: Dataset, cfg: CompareConfig, on_batch=None
) -> dict:
    """Trains a copy of `base` under `policy` and returns its results row.

    Args:
        policy: a name from `keras_mp.cli.settings.POLICIES`.
        base: the float32 model every mode starts from (not modified).
        data: the `Dataset`.
        cfg: the `CompareConfig`.
        on_batch: optional callable run after every training batch (progress bars).

    Returns:
        A dict: the row of `results.json` (see `run_compare`), without `verdict` and the
        FP32-relative columns.
    """
    steps_per_epoch = math.ceil(len(data.x_train) / cfg.batch_size)
    keras.utils.set_random_seed(cfg.seed)  # same batch order in every mode
    calibrate = data.x_train[:CALIBRATION_SAMPLES] if policy == CALIBRATED else None
    with _pure_modes_expected():
        model = kmp.convert(base, _policy(policy), calibrate=calibrate)
    opt = _optimizer(cfg, cfg.epochs * steps_per_epoch)
    if policy in ("mixed_float16", CALIBRATED):
        opt = kmp.LossScaleOptimizer(opt)
    variant = lean_variant(policy)
    if variant:
        opt = kmp.LeanOptimizer(opt, rounding=variant[0], moments=variant[1])
    jit_compile, compile_label = _jit(policy, cfg.jit)
    model.compile(
        optimizer=opt,
        loss=kmp_losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
    )
    recorder = EpochRecorder(on_batch)
    callbacks = [recorder]
    monitor = None
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        monitor = kmp_callbacks.LossScaleMonitor()
        callbacks.insert(0, monitor)
    reset_peak_memory(_memory_device())
    start = time.perf_counter()
    model.fit(
        data.x_train,
        data.y_train,
        batch_size=cfg.batch_size,
        epochs=cfg.epochs,
        validation_data=(data.x_val, data.y_val),
        validation_batch_size=len(data.x_val),  # one compiled test-step shape
        shuffle=True,
        verbose=0,
        callbacks=callbacks,
    )
    wall = time.perf_counter() - start
    epochs = recorder.epochs
    times = [e["train_seconds"] for e in epochs]
    steady = times[1:] or times  # the first epoch includes tracing and compilation
    steady_s = float(np.median(steady))
    last = epochs[-1]
    row = {
        "policy": policy,
        "label": _label(policy),
        "compile": compile_label,
        "variable_dtype": model.trainable_variables[0].dtype,
        "compute_dtype": _policy(policy).compute_dtype,
        "val_accuracy": last["val_accuracy"],
        "val_loss": last["val_loss"],
        "train_loss": last["train_loss"],
        "first_train_loss": epochs[0]["train_loss"],
        "steps_per_second": steps_per_epoch / steady_s if steady_s > 0 else None,
        "compile_seconds": max(0.0, times[0] - steady_s) if len(times) > 1 else None,
        "wall_seconds": wall,
        "peak_memory_bytes": peak_memory(_memory_device()),
        "state_bytes_per_parameter": round(kmp.state_bytes(model).per_parameter, 3),
        "state_bytes": kmp.state_bytes(model).to_dict(),
        "frozen_fraction": last["frozen_fraction"],
        "skipped_steps": None,
        "final_loss_scale": None,
        "history": {k: [e[k] for e in epochs] for k in epochs[0]},
        "fp32_pins": [p.path for p in model.precision_plan.pins],
    }
    if isinstance(model.optimizer, kmp.LeanOptimizer):  # what the lean state stores
        row["lean_state"] = {
            "rounding": model.optimizer.rounding,
            "moments": model.optimizer.moments,
        }
    cal = model.precision_plan.calibration
    if cal is not None:
        row["fp32_flops"] = cal.fp32_flops
    counter = getattr(model.optimizer, "skipped_steps", None)
    if counter is not None:  # also the skip-only scaler and lean's own count: no scale
        row["skipped_steps"] = int(keras.ops.convert_to_numpy(counter.value))
    if monitor is not None:
        row["final_loss_scale"] = float(keras.ops.convert_to_numpy(opt.dynamic_scale.value))
        row["history"]["loss_scale"] = {
            "step": list(monitor.history["step"]),
            "value": [float(v) for v in monitor.history["loss_scale"]],
        }
    return row


def _memory_device() -> str:
    """The TensorFlow allocator whose peak the table shows: the first GPU, else the CPU
    one (oneDNN's, which keeps statistics where the CPU has AVX512 neural-network
    instructions; elsewhere it reports nothing)."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    return "GPU"


def _memory_source(rows: list[dict]) -> str | None:
    """What the `peak mem` column measured, or None where the backend reported nothing."""
    if all(r.get("peak_memory_bytes") is None for r in rows):
        return None
    if keras.backend.backend() == "tensorflow":
        if _memory_device() == "CPU":
            return "TensorFlow's CPU allocator peak in each mode (tensors, not the process RSS)"
        return "TensorFlow's GPU allocator peak in each mode"
    return "the device's peak so far in this process (JAX cannot reset it: an upper bound)"


def _speed(cfg: CompareConfig, base: keras.Model, rows: list[dict]) -> dict:
    """Why the rows run at their speed: the model's FLOPs a step and, on a full run where
    the machine has low-precision matrix units, a matmul-bound step timed side by side
    (`keras_mp.cli.compare_speed`; a quick `--limit` run skips it)."""
    from keras_mp.cli.compare_speed import low_precision_units, matmul_probe, train_flops

    speed = {"train_gflop": train_flops(base, cfg.batch_size) / 1e9}
    policy, hardware = low_precision_units()
    if policy is None:
        speed["hardware"] = hardware
    low = [r for r in rows if r["policy"] != "float32" and not r.get("error")]
    if policy is not None and low and cfg.limit is None:
        try:
            speed["probe"] = matmul_probe()
        except Exception as e:  # noqa: BLE001 - the table matters more than the probe
            speed["probe_error"] = f"{type(e).__name__}: {e}"[:200]
    return speed


def _failed_row(policy: str, error: Exception) -> dict:
    message = " ".join(str(error).split())
    row = {
        k: None
        for k in (
            "val_accuracy",
            "val_loss",
            "train_loss",
            "first_train_loss",
            "steps_per_second",
            "frozen_fraction",
            "peak_memory_bytes",
            "state_bytes_per_parameter",
            "skipped_steps",
            "final_loss_scale",
        )
    }
    return {
        **row,
        "policy": policy,
        "label": _label(policy),
        "compile": _jit(policy, "auto")[1],
        "history": {},
        "error": f"{type(error).__name__}: {message[:300]}",
    }


def _finite(*values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def is_lean(row: dict) -> bool:
    """Whether a results row trained the lean state (`lean_bfloat16`, any variant; rows
    written before `lean_state` was recorded are known by their policy)."""
    return bool(row.get("lean_state")) or str(row.get("policy", "")).split(":")[0] == (
        "lean_bfloat16"
    )


def verdict(row: dict, reference: dict | None) -> str:
    """Classifies a results row against the float32 row (see `THRESHOLDS`).

    Args:
        row: a results row (`val_accuracy`, `val_loss`, `train_loss`, `first_train_loss`,
            `frozen_fraction`; `lean_state` for a `kmp.LeanOptimizer` row, which is never
            "stalled": see `THRESHOLDS`).
        reference: the float32 row, or `None` when float32 was not run.

    Returns:
        `"reference"`, `"diverged"`, `"matches FP32"`, `"higher"`, `"stalled"`, `"lower"`,
        `"error"` (the mode could not run), or `"n/a"` (no float32 row to compare with).
    """
    if row.get("error"):
        return "error"
    if not _finite(row["val_loss"], row["train_loss"]) or row["train_loss"] > (
        THRESHOLDS["diverged_loss_growth"] * row["first_train_loss"]
    ):
        return "diverged"
    if reference is None:
        return "n/a"
    if row is reference:
        return "reference"
    diff = row["val_accuracy"] - reference["val_accuracy"]
    if abs(diff) <= THRESHOLDS["match_accuracy"]:
        return "matches FP32"
    if diff > 0:
        return "higher"
    if row["frozen_fraction"] >= THRESHOLDS["stalled_frozen_fraction"] and not is_lean(row):
        return "stalled"
    return "lower"


def _relative(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["policy"] == "float32" and not r.get("error")), None)
    for r in rows:
        r["verdict"] = verdict(r, ref)
        ok = ref is not None and _finite(r["val_accuracy"], ref["val_accuracy"])
        r["accuracy_diff"] = r["val_accuracy"] - ref["val_accuracy"] if ok else None
        sps = r["steps_per_second"]
        ref_sps = ref["steps_per_second"] if ref is not None else None
        r["speed_ratio"] = sps / ref_sps if sps and ref_sps else None


def run_compare(cfg: CompareConfig, progress=None) -> dict:
    """Runs every policy of `cfg` and returns the content of `results.json`.

    Args:
        cfg: the `CompareConfig`.
        progress: optional `(policy, total_steps) -> (advance_callable, done_callable)`
            factory for progress display.

    Returns:
        A dict with `config`, `environment`, `thresholds`, `data`, `rows` (one per policy:
        `policy`, `label`, `compile`, `val_accuracy`, `val_loss`, `train_loss`,
        `accuracy_diff`, `steps_per_second`, `speed_ratio`, `peak_memory_bytes`,
        `state_bytes_per_parameter` (persistent training state, `kmp.state_bytes`),
        `skipped_steps`, `final_loss_scale`, `frozen_fraction`, `verdict`, `history`,
        `lean_state` (a lean row's `rounding` and `moments`), ...), `speed` (the model's
        `train_gflop` a step, the `hardware` phrase and, on a full run where the machine
        has bfloat16/float16 matrix units, the side-by-side `probe` of
        `keras_mp.cli.compare_speed.matmul_probe`) and `wall_seconds`.
    """
    import platform

    start = time.perf_counter()
    data = load_dataset(cfg.model, seed=cfg.seed, limit=cfg.limit)
    keep = len(data.x_train) // cfg.batch_size * cfg.batch_size
    if 0 < keep < len(data.x_train):  # whole batches only: one compiled train-step shape
        data = data._replace(x_train=data.x_train[:keep], y_train=data.y_train[:keep])
    base = build_model(cfg.model, data, seed=cfg.seed)
    steps = cfg.epochs * math.ceil(len(data.x_train) / cfg.batch_size)
    rows = []
    previous = keras.config.dtype_policy()
    try:
        for policy in cfg.policies:
            advance, done = progress(policy, steps) if progress else (None, None)
            try:
                rows.append(run_policy(policy, base, data, cfg, on_batch=advance))
            except Exception as e:  # e.g. no float16 matmul on this device: reported, not fatal
                rows.append(_failed_row(policy, e))
            if done:
                done(rows[-1])
    finally:
        keras.config.set_dtype_policy(previous)
    _relative(rows)
    speed = _speed(cfg, base, rows)
    return {
        "config": {**dataclasses.asdict(cfg), "policies": list(cfg.policies)},
        "data": {
            "name": data.name,
            "train_samples": len(data.x_train),
            "val_samples": len(data.x_val),
            "num_classes": data.num_classes,
            "steps_per_epoch": math.ceil(len(data.x_train) / cfg.batch_size),
        },
        "model": {"name": base.name, "parameters": int(base.count_params())},
        "environment": {
            "backend": keras.backend.backend(),
            "keras": keras.__version__,
            "keras_mp": kmp.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor() or "unknown",
            "peak_memory_source": _memory_source(rows),
        },
        "speed": speed,
        "thresholds": dict(THRESHOLDS),
        "rows": rows,
        "wall_seconds": time.perf_counter() - start,
    }
