"""Why `keras-mp compare`'s low-precision rows run at the speed they do, measured.

The comparison's model is small on purpose (it trains 20 epochs of every mode in under a
minute), so its step is bound by per-op overhead, not arithmetic: low precision has nothing
to speed up and adds casts. This module measures that and, where the machine has bfloat16
or float16 matrix units (`kmp.hardware.report()`), times a matmul-bound step side by side
in float32 and the recommended low-precision policy, so the table says both.

* `train_flops(model, batch)`: the matmul and convolution FLOPs of one training step
  (3x the forward pass: the forward product and two backward ones).
* `matmul_probe(seconds)`: float32 vs the recommended policy on a wide MLP step.
* `speed_notes(results)`: the sentences the table prints under it.

Example:

```python
from keras_mp.cli.compare_speed import matmul_probe

probe = matmul_probe()   # None where nothing accelerates low precision
```
"""

from __future__ import annotations

import math
import time

import keras
import numpy as np

__all__ = ["PROBE", "low_precision_units", "matmul_probe", "speed_notes", "train_flops"]

# A step reaching less than this share of the machine's matmul throughput is bound by
# per-op overhead; without a probe, a step under SMALL_GFLOP is taken to be.
OVERHEAD_SHARE = 0.5
SMALL_GFLOP = 0.5
# The side-by-side workload: a wide MLP whose step is >95% matmul FLOPs.
PROBE = {"batch": 128, "width": 1024, "hidden": 2048, "classes": 10}


def train_flops(model, batch: int) -> float:
    """FLOPs of the Dense and Conv layers in one training step of `batch` samples.

    Counted from the layers' kernels and output shapes (a functional or Sequential model),
    3x the forward pass. Other layers (normalization, pooling, attention's einsums) are
    left out: this is the arithmetic low precision can speed up.
    """
    total = 0.0
    for layer in model._flatten_layers(include_self=False):
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            continue
        try:
            out = layer.output.shape
        except (AttributeError, ValueError):
            continue
        if isinstance(layer, keras.layers.Dense):
            positions = math.prod(d for d in out[1:-1] if d) or 1
            total += 2.0 * positions * kernel.shape[0] * kernel.shape[1]
        elif isinstance(layer, keras.layers.Conv2D):
            positions = math.prod(d for d in out[1:-1] if d)
            total += 2.0 * positions * math.prod(kernel.shape)
    return 3.0 * batch * total


def low_precision_units() -> tuple[str | None, str]:
    """`(policy, what)`: the recommended low-precision policy where the machine
    accelerates it (else None), and a phrase naming the hardware."""
    import keras_mp as kmp

    report = kmp.hardware.report()
    device = report.devices[0] if report.devices else None
    kind = "GPU" if device is not None and device.kind.upper() == "GPU" else "CPU"
    if device is None or not (device.bf16 or device.fp16):
        return None, f"this {kind} has no bfloat16 or float16 matrix units (kmp.hardware.report())"
    flags = [f.upper().replace("_", "-") for f in report.cpu_flags if "bf16" in f or "fp16" in f]
    units = ", ".join(flags) if kind == "CPU" and flags else device.model or kind
    policy = report.recommended_policy
    if policy in (None, "float32"):  # e.g. JAX's XLA:CPU, which does not use them
        why = report.reasons[0] if report.reasons else "this backend does not use them"
        return None, f"this {kind} has {units}, but {why} (kmp.hardware.report())"
    return policy, f"{kind} with {units}"


def _probe_model(policy: str):
    import keras_mp as kmp

    p = PROBE
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((p["width"],)),
            keras.layers.Dense(p["hidden"], activation="relu"),
            keras.layers.Dense(p["width"], activation="relu"),
            keras.layers.Dense(p["classes"]),
        ]
    )
    if policy != "float32":
        model = kmp.convert(model, policy)
    model.compile(
        keras.optimizers.Adam(1e-4),
        kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=keras.backend.backend() == "jax",  # XLA:CPU uses no bfloat16 units on TF
    )
    return model


def matmul_probe(steps: int = 4) -> dict | None:
    """Times a wide-MLP train step in float32 and in the recommended low-precision policy.

    The two modes alternate step by step (so a change in the machine's load hits both),
    after two warm-up steps each; the median is kept.

    Returns:
        `{"policy", "hardware", "workload", "train_gflop", "float32_ms", "low_ms",
        "speedup", "float32_gflops"}`, or None where no low-precision unit exists.
    """
    policy, hardware = low_precision_units()
    if policy is None:
        return None
    p = PROBE
    rng = np.random.default_rng(0)
    x = rng.normal(size=(p["batch"], p["width"])).astype("float32")
    y = rng.integers(0, p["classes"], size=(p["batch"],))
    models = {"float32": _probe_model("float32"), policy: _probe_model(policy)}
    times: dict[str, list] = {name: [] for name in models}
    for i in range(steps + 2):
        for name, model in models.items():
            start = time.perf_counter()
            model.train_on_batch(x, y)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    f32 = float(np.median(times["float32"]))
    low = float(np.median(times[policy]))
    flops = train_flops(models["float32"], p["batch"])
    return {
        "policy": policy,
        "hardware": hardware,
        "workload": (
            f"MLP {p['width']}-{p['hidden']}-{p['width']}, batch {p['batch']}, "
            f"{flops / 1e9:.1f} GFLOP a step"
        ),
        "train_gflop": flops / 1e9,
        "float32_ms": 1e3 * f32,
        "low_ms": 1e3 * low,
        "speedup": f32 / low,
        "float32_gflops": flops / f32 / 1e9,
    }


def speed_notes(results: dict) -> list[str]:
    """The sentences on speed printed under the table, from `results.json`'s content."""
    rows = [r for r in results["rows"] if not r.get("error")]
    ref = next((r for r in rows if r["policy"] == "float32"), None)
    speed = results.get("speed") or {}
    probe = speed.get("probe")
    out = []
    ratios = [r["speed_ratio"] for r in rows if r is not ref and r.get("speed_ratio")]
    flops = speed.get("train_gflop")
    if ref and ratios and flops and ref.get("steps_per_second"):
        achieved = flops * ref["steps_per_second"]
        why = (
            f"speed: a step of this model is {1e3 * flops:.0f} MFLOP of matmuls and "
            f"convolutions, done in {1e3 / ref['steps_per_second']:.1f} ms in float32 "
            f"({achieved:.1f} GFLOP/s"
        )
        if probe:
            share = achieved / probe["float32_gflops"]
            why += (
                f", {100 * share:.0f}% of the {probe['float32_gflops']:.0f} GFLOP/s this "
                "machine reaches on a matmul-bound step)"
            )
            bound = share < OVERHEAD_SHARE
        else:
            why += ")"
            bound = flops < SMALL_GFLOP
        if bound and max(ratios) < 1.0:
            why += (
                ": the step time is per-op overhead, not arithmetic, so low precision has "
                "nothing to speed up and its casts (at every float32 boundary: inputs, kept "
                "layers, the loss) and the skip check on the gradients cost time, hence "
                "every low-precision row below 1.0x."
            )
        elif bound:
            why += (
                ": the step time is per-op overhead, not arithmetic, so the rows' speeds "
                "differ by their casts and by the machine's load, not by the precision's "
                "arithmetic."
            )
        else:
            why += "."
        out.append(why)
    if probe:
        out.append(
            f"speed where the arithmetic dominates ({probe['hardware']}): {probe['workload']}: "
            f"{probe['policy']} {probe['low_ms']:.0f} ms vs float32 {probe['float32_ms']:.0f} "
            f"ms a step, {probe['speedup']:.2f}x (measured side by side in this run)."
        )
    elif speed.get("hardware"):
        out.append(
            f"speed: {speed['hardware']}: low precision cannot be faster than float32 here "
            "(no side-by-side probe); it saves memory."
        )
    return out
