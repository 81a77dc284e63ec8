"""kmp.hardware: capability detection, the recommendation and the TF32 switch."""

import json

import keras
import pytest

import keras_mp as kmp
from keras_mp.hardware.capabilities import Device, _cpu_device, _gpu_device, cpu_features, recommend

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
GRAVITON3 = """processor\t: 0
Features\t: fp asimd evtstrm aes fphp asimdhp bf16 i8mm sve
"""
OLD_X86 = "flags\t\t: fpu sse sse2 avx avx2 fma f16c\n"

GPUS = [  # compute capability, fp16, bf16, fp8, recommended policy
    ((6, 1), False, False, False, "float32"),  # Pascal: no tensor cores
    ((7, 0), True, False, False, "mixed_float16"),  # V100
    (("7", "5"), True, False, False, "mixed_float16"),  # T4 (JAX reports strings)
    ((8, 0), True, True, False, "mixed_bfloat16"),  # A100
    ((8, 9), True, True, True, "mixed_bfloat16"),  # L4 / RTX 4090
    ((9, 0), True, True, True, "mixed_bfloat16"),  # H100
]


def test_cpu_and_gpu_capabilities_and_recommendations():
    spr = cpu_features(SAPPHIRE_RAPIDS)
    assert {"avx512_bf16", "amx_bf16", "avx512_fp16"} <= spr
    assert cpu_features("no flags here") == frozenset()
    assert _cpu_device(spr) == Device("cpu:0", "CPU", fp16=True, bf16=True)
    assert _cpu_device(cpu_features(GRAVITON3)) == Device("cpu:0", "CPU", fp16=True, bf16=True)
    assert _cpu_device(cpu_features(OLD_X86)) == Device("cpu:0", "CPU")  # f16c: conversion only

    for cc, fp16, bf16, fp8, policy in GPUS:
        gpu = _gpu_device("gpu:0", "test", cc)
        assert (gpu.fp16, gpu.bf16, gpu.fp8) == (fp16, bf16, fp8), cc
        got, jit, reasons = recommend([Device("cpu:0", "CPU"), gpu], "jax")
        assert (got, jit) == (policy, True), cc
        assert any("FP8" in r for r in reasons) == fp8, cc
    # Mixed fleet: the weakest accelerator decides.
    mixed = [_gpu_device("a", "", (8, 0)), _gpu_device("b", "", (7, 0))]
    assert recommend([Device("cpu:0", "CPU"), *mixed], "tensorflow")[0] == "mixed_float16"

    # CPU only (measured): bfloat16 pays off with TensorFlow's oneDNN kernels, not under XLA.
    amx = Device("cpu:0", "CPU", bf16=True)
    assert recommend([amx], "tensorflow")[:2] == ("mixed_bfloat16", False)
    assert recommend([amx], "jax")[:2] == ("float32", True)
    assert recommend([Device("cpu:0", "CPU")], "tensorflow")[:2] == ("float32", False)


def test_report_and_tf32_switch_on_this_machine():
    report = kmp.hardware.report()
    assert report.backend == keras.backend.backend()
    cpu = report.devices[0]
    flags = cpu_features()
    assert cpu.kind == "CPU" and cpu.bf16 == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert set(report.cpu_flags) <= flags
    expected = recommend(list(report.devices), report.backend)
    assert (report.recommended_policy, report.recommended_jit_compile) == expected[:2]
    text = str(report)
    assert f"Keras backend: {report.backend}" in text
    assert f"Recommended: policy {report.recommended_policy!r}" in text
    json.dumps(report.to_dict())

    before = kmp.hardware.tf32_enabled()
    try:
        kmp.hardware.set_tf32(False)
        assert kmp.hardware.tf32_enabled() is False
        assert kmp.hardware.report().tf32 is False
        kmp.hardware.set_tf32(True)
        assert kmp.hardware.tf32_enabled() is True
    finally:
        kmp.hardware.set_tf32(bool(before))
    with pytest.raises(ValueError, match="`enabled` must be True or False"):
        kmp.hardware.set_tf32("yes")
