"""What this machine accelerates, which policy to train with, the TF32 switch, and the
deterministic mode (`set_deterministic`, implemented in `keras_mp.hardware.determinism`).

`report()` lists the devices the current Keras backend sees, whether each runs FP16,
BF16 and FP8 fast (GPU compute capability >= 7.0 / 8.0 / 8.9; CPUs with AVX512-FP16,
AVX512-BF16 or AMX), the TF32 state, and the recommended policy and `jit_compile`.
`set_tf32(enabled)` switches TF32 matmuls for the backend in use.

The CPU recommendation follows measurements (benchmarks/BENCHMARKS.md): on CPUs with
AVX512-BF16/AMX, TensorFlow's oneDNN kernels run bfloat16 matmuls several times faster than
float32, but not under XLA (XLA:CPU does not use AMX); JAX's CPU backend gains nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import keras

__all__ = [
    "Device",
    "HardwareReport",
    "cpu_features",
    "recommend",
    "report",
    "set_tf32",
    "tf32_enabled",
]

_CPU_FP16 = ("avx512_fp16", "amx_fp16", "fphp", "asimdhp")  # x86 flags, ARM features
_CPU_BF16 = ("avx512_bf16", "amx_bf16", "bf16")
_CPU_RELEVANT = _CPU_FP16 + _CPU_BF16 + ("amx_tile", "avx512f", "f16c")


@dataclasses.dataclass(frozen=True)
class Device:
    """One device and the low-precision formats it runs fast.

    Attributes:
        name: the backend's name for it (e.g. `/physical_device:GPU:0`, `cuda:0`).
        kind: `"CPU"`, `"GPU"` or `"TPU"`.
        model: the product name when known.
        compute_capability: `(major, minor)` for NVIDIA GPUs, else None.
        fp16 / bf16 / fp8: whether it accelerates that format.
    """

    name: str
    kind: str
    model: str = ""
    compute_capability: tuple | None = None
    fp16: bool = False
    bf16: bool = False
    fp8: bool = False


@dataclasses.dataclass(frozen=True)
class HardwareReport:
    """The result of `report()`; printable, and `to_dict()` for JSON."""

    backend: str
    devices: tuple
    cpu_flags: tuple
    tf32: bool | None
    recommended_policy: str
    recommended_jit_compile: bool
    reasons: tuple

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        def yes(b):
            return "yes" if b else "no"

        lines = [f"Keras backend: {self.backend}"]
        for d in self.devices:
            cc = (
                f", compute capability {d.compute_capability[0]}.{d.compute_capability[1]}"
                if d.compute_capability
                else ""
            )
            lines.append(
                f"  {d.kind} {' '.join(filter(None, (d.name, d.model)))}{cc}: "
                f"FP16 {yes(d.fp16)}, BF16 {yes(d.bf16)}, FP8 {yes(d.fp8)}"
            )
        lines.append(f"CPU flags: {' '.join(self.cpu_flags) or '(none relevant)'}")
        tf32 = {None: "unknown", True: "allowed", False: "off"}[self.tf32]
        lines.append(f"TF32 for float32 matmuls (Ampere+ GPUs): {tf32}")
        lines.append(
            f"Recommended: policy {self.recommended_policy!r}, "
            f"jit_compile={self.recommended_jit_compile}"
        )
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)


def cpu_features(cpuinfo: str | None = None) -> frozenset:
    """The CPU feature flags, from `/proc/cpuinfo` (x86 `flags`, ARM `Features`).

    Args:
        cpuinfo: the text to parse; default reads `/proc/cpuinfo` (empty set if absent).

    Returns:
        A frozenset of lower-case flag names.
    """
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return frozenset()


def _cpu_device(flags: frozenset) -> Device:
    return Device(
        name="cpu:0",
        kind="CPU",
        fp16=bool(flags & set(_CPU_FP16)),
        bf16=bool(flags & set(_CPU_BF16)),
    )


def _gpu_device(name: str, model: str, cc: tuple | None) -> Device:
    cc = tuple(int(c) for c in cc) if cc else None
    return Device(
        name=name,
        kind="GPU",
        model=model,
        compute_capability=cc,
        fp16=bool(cc and cc >= (7, 0)),
        bf16=bool(cc and cc >= (8, 0)),
        fp8=bool(cc and cc >= (8, 9)),
    )


def _devices(backend: str, flags: frozenset) -> list:
    out = []
    if backend == "tensorflow":
        import tensorflow as tf

        for d in tf.config.list_physical_devices():
            if d.device_type == "GPU":
                details = tf.config.experimental.get_device_details(d)
                out.append(
                    _gpu_device(
                        d.name, details.get("device_name", ""), details.get("compute_capability")
                    )
                )
            elif d.device_type == "TPU":
                out.append(Device(d.name, "TPU", fp16=False, bf16=True))
    elif backend == "jax":
        import jax

        for d in jax.devices():
            if d.platform == "gpu":
                cc = getattr(d, "compute_capability", None)
                cc = tuple(str(cc).split(".")) if cc else None
                out.append(_gpu_device(str(d), d.device_kind, cc))
            elif d.platform == "tpu":
                out.append(Device(str(d), "TPU", d.device_kind, bf16=True))
    elif backend == "torch":
        import torch

        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            out.append(
                _gpu_device(
                    f"cuda:{i}", torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)
                )
            )
    return [_cpu_device(flags), *out]


def recommend(devices, backend: str) -> tuple[str, bool, list]:
    """The policy and `jit_compile` for these devices: `(policy, jit_compile, reasons)`."""
    accel = [d for d in devices if d.kind != "CPU"]
    if accel:
        jit = True
        if all(d.bf16 for d in accel):
            best = "mixed_bfloat16"
            why = (
                "accelerators run BF16 natively (compute capability >= 8.0 or TPU): no loss "
                "scaling needed"
            )
        elif all(d.fp16 for d in accel):
            best = "mixed_float16"
            why = (
                "GPU tensor cores run FP16 (compute capability 7.x) but not BF16: use FP16 "
                "with kmp.LossScaleOptimizer"
            )
        else:
            best, why = "float32", "a GPU older than compute capability 7.0 has no tensor cores"
        reasons = [why, "XLA (jit_compile=True) fuses the casts around low-precision ops"]
        if all(d.fp8 for d in accel):
            reasons.append("FP8 is supported too (compute capability >= 8.9): see 'float8'")
        return best, jit, reasons
    cpu = devices[0]
    if backend == "tensorflow" and cpu.bf16:
        reasons = [
            "this CPU has AVX512-BF16/AMX and TensorFlow's oneDNN kernels use them: "
            "transformer train steps gain most, convolutional ones less (their weight "
            "gradients and the FP32 optimizer update do not speed up)",
            "jit_compile=False: XLA:CPU does not use AMX (bfloat16 matmuls are much slower "
            "with it)",
            "measure your model: keras-mp bench --models cpu_gpt "
            "--policies float32@nojit,keras_mp_mixed_bfloat16@nojit",
        ]
        if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0":
            reasons.append(
                "warning: TF_ENABLE_ONEDNN_OPTS=0 disables oneDNN: bfloat16 is then slower "
                "than float32; unset it"
            )
        return "mixed_bfloat16", False, reasons
    return (
        "float32",
        backend == "jax",
        [
            "no accelerator; this backend's CPU kernels gain nothing from FP16/BF16 here",
        ],
    )


def tf32_enabled(backend: str | None = None) -> bool | None:
    """Whether float32 matmuls may use TF32 on the backend (None: not applicable/unknown)."""
    backend = backend or keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.experimental.tensor_float_32_execution_enabled())
    if backend == "jax":
        import jax

        # None/"default"/"tensorfloat32"/"bfloat16" let XLA use TF32 on Ampere+ GPUs.
        return jax.config.jax_default_matmul_precision not in ("float32", "highest")
    if backend == "torch":
        import torch

        return bool(torch.backends.cuda.matmul.allow_tf32)
    return None


def set_tf32(enabled: bool) -> None:
    """Allows (or forbids) TF32 for float32 matmuls/convolutions.

    Sets it for the current Keras backend and for any other backend module already
    imported (TensorFlow: `tensor_float_32_execution`; JAX: `jax_default_matmul_precision`
    "tensorfloat32" / "float32"; PyTorch: `allow_tf32` for CUDA matmuls and cuDNN).
    TF32 only matters on NVIDIA GPUs from Ampere (compute capability 8.0) on.

    Args:
        enabled: True to allow TF32, False for full float32.

    Example:

    >>> kmp.hardware.set_tf32(False)  # bit-exact float32 for a reference run
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"set_tf32: `enabled` must be True or False, got {enabled!r}.")
    current = keras.backend.backend()
    if current == "tensorflow" or "tensorflow" in sys.modules:
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(enabled)
    if current == "jax" or "jax" in sys.modules:
        import jax

        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if enabled else "float32")
    if current == "torch" or "torch" in sys.modules:
        import torch

        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def report() -> HardwareReport:
    """Describes what this machine accelerates and how to train on it.

    Returns:
        A `HardwareReport` (print it, or `to_dict()`).

    Example:

    >>> print(kmp.hardware.report())  # doctest: +SKIP
    """
    backend = keras.backend.backend()
    flags = cpu_features()
    devices = _devices(backend, flags)
    policy, jit, reasons = recommend(devices, backend)
    return HardwareReport(
        backend=backend,
        devices=tuple(devices),
        cpu_flags=tuple(sorted(flags & set(_CPU_RELEVANT))),
        tf32=tf32_enabled(backend),
        recommended_policy=policy,
        recommended_jit_compile=jit,
        reasons=tuple(reasons),
    )
