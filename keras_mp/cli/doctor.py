"""`keras-mp doctor`: what this machine accelerates and which policy to train with."""

from __future__ import annotations

__all__ = ["run"]


def run(args) -> int:
    """Prints `kmp.hardware.report()`; returns the exit status."""
    import keras

    from keras_mp import hardware

    print(f"keras {keras.__version__}, backend {keras.backend.backend()}")
    print(hardware.report())
    return 0
