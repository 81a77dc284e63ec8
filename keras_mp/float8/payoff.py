"""Whether FP8 matmuls will pay for a model on this machine, said before a run.

FP8 halves a matmul's operand bytes and doubles Hopper's tensor-core rate, but every FP8
layer adds quantize, scale and amax-history work that does not shrink with the matmul. Below
a size the added work wins. Measured and published:

- keras_mp on an H200, a 168M GPT (matmuls 1024 x 1024 and 1024 x 4096): `float8` 1.30x
  slower than `mixed_bfloat16` (benchmarks/BENCHMARKS.md 16.3);
- TransformerEngine on an H100, a 1.5B GPT (1600 x 1600 and 1600 x 6400): +1.6%;
- torchao's float8 training benchmark: 0.80x on small matmuls, gains from about 4096 a side.

So FP8 pays where the matmuls' typical side, sqrt(inputs x outputs) of each FP8 kernel
weighted by its size, is about 4096 or more (Llama-3-8B: 7663), and never where no device
has FP8 tensor cores (NVIDIA compute capability 8.9 or later: L4, L40S, RTX 40xx, H100,
H200), where it is emulated.
"""

from __future__ import annotations

import math
import warnings

import keras

__all__ = [
    "PAYS_FROM_SIDE",
    "Float8SlowerWarning",
    "float8_layers",
    "float8_speedup_expected",
    "float8_speedup_reason",
    "typical_side",
    "warn_if_float8_will_not_pay",
]

PAYS_FROM_SIDE = 4096
"""The typical matmul side from which FP8 training is expected to pay on FP8 hardware."""


class Float8SlowerWarning(UserWarning):
    """`convert(model, "float8")` expects FP8 to be slower than bfloat16 here. Filter it
    with `warnings.filterwarnings("ignore", category=kmp.float8.Float8SlowerWarning)`."""


def float8_layers(model: keras.Model) -> list:
    """The layers of `model` (nested ones included) that run FP8 matmuls."""
    return [x for x in model._flatten_layers(include_self=False) if x.quantization_mode == "float8"]


def _sides(kernel_shape, equation=None) -> tuple[int, int]:
    """(inputs, outputs) of a Dense kernel, or of an EinsumDense kernel whose contracted
    axes are read off its equation (`"abc,cde->abde"`: c in, d and e out)."""
    shape = [int(d) for d in kernel_shape]
    if equation is None or "->" not in equation or "," not in equation:
        return math.prod(shape[:-1]), shape[-1]
    inputs, rest = equation.split(",", 1)
    kernel, output = rest.split("->")
    contracted = math.prod(d for d, a in zip(shape, kernel) if a in inputs and a not in output)
    return contracted, math.prod(shape) // max(contracted, 1)


def typical_side(model: keras.Model) -> float | None:
    """The FP8 matmuls' typical side: sqrt(inputs x outputs) of each FP8 layer's kernel,
    averaged with the kernels' sizes as weights (`None`: no FP8 layer)."""
    total = weighted = 0.0
    for layer in float8_layers(model):
        kernel = getattr(layer, "_kernel", None)
        kernel = getattr(layer, "kernel", None) if kernel is None else kernel
        if kernel is None:
            continue
        k, n = _sides(kernel.shape, getattr(layer, "equation", None))
        total += k * n
        weighted += k * n * math.sqrt(k * n)
    return weighted / total if total else None


def _device_verdict(devices) -> tuple[bool, str, object]:
    """(FP8 tensor cores on every GPU, why, the first such GPU)."""
    gpus = [d for d in devices if d.kind == "GPU"]
    if not gpus:
        why = "no GPU: FP8 matmuls run emulated (quantize-dequantize), slower than bf16"
        return False, why, None
    slow = [d for d in gpus if not d.fp8]
    if slow:
        d = slow[0]
        cc = ".".join(map(str, d.compute_capability or ())) or "unknown"
        return False, (
            f"{d.model or d.name} (compute capability {cc}) has no FP8 tensor "
            "cores (needs >= 8.9): FP8 runs emulated"
        ), None
    d = gpus[0]
    return True, (
        f"{d.model or d.name} has FP8 tensor cores: expect FP8 GEMMs when compiled "
        "with XLA (jit_compile=True)"
    ), d


def _verdict(model, devices) -> tuple[bool, str]:
    if devices is None:
        from keras_mp.hardware import report

        devices = report().devices
    fast, why, gpu = _device_verdict(devices)
    side = typical_side(model) if model is not None else None
    if not fast or side is None or side >= PAYS_FROM_SIDE:
        return fast, why
    return False, (
        f"this model's FP8 matmuls are about {side:.0f} a side (sqrt(inputs x outputs), "
        f"weighted by size) on {gpu.model or gpu.name}; FP8's per-layer quantize and "
        f"scaling work outweighs the faster matmul below about {PAYS_FROM_SIDE}: keras_mp "
        "measured 1.30x slower than bfloat16 at 1024 (a 168M GPT, H200), TransformerEngine "
        "+1.6% at 1600 (a 1.5B GPT, H100). Expect 'mixed_bfloat16' to be faster"
    )


def float8_speedup_expected(model: keras.Model | None = None, devices=None) -> bool:
    """Whether FP8 training can be faster than bfloat16 here: every GPU has FP8 tensor
    cores (compute capability >= 8.9) and, given `model` (with FP8 layers), its FP8 matmuls
    are about `PAYS_FROM_SIDE` a side or more.

    Args:
        model: optional; a model after `kmp.convert(model, "float8")`.
        devices: `kmp.hardware.Device`s (default: this machine's).
    """
    return _verdict(model, devices)[0]


def float8_speedup_reason(model: keras.Model | None = None, devices=None) -> str:
    """One line saying why `float8_speedup_expected` is what it is (same arguments)."""
    return _verdict(model, devices)[1]


def warn_if_float8_will_not_pay(model: keras.Model, devices=None) -> None:
    """Warns (`Float8SlowerWarning`) when FP8 is not expected to be faster here."""
    fast, why = _verdict(model, devices)
    if not fast:
        warnings.warn(
            f"float8 for {model.name!r}: {why}. (Silence: "
            "warnings.filterwarnings('ignore', category=kmp.float8.Float8SlowerWarning))",
            Float8SlowerWarning,
            stacklevel=3,
        )
