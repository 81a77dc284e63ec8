"""`keras-mp doctor`: what this machine accelerates and which policy to train with."""

from __future__ import annotations

__all__ = ["run"]


def run(args) -> int:
    """Prints `kmp.hardware.report()`; returns the exit status."""
    import keras

    import keras_mp.hardware as hardware

    report = hardware.report()
    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    print(report)
    if not any(d.kind != "CPU" for d in report.devices):
        print(f"No GPU or TPU found: {report.backend} runs on the CPU.")
    return 0
