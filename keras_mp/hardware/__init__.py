"""What this machine accelerates, TF32, and the deterministic mode (`kmp.hardware`).

The face of the subpackage: device capabilities and the recommended policy
(`capabilities.py`) and `set_deterministic` (`determinism.py`).
"""

from keras_mp.hardware.capabilities import (
    Device,
    HardwareReport,
    cpu_features,
    recommend,
    report,
    set_tf32,
    tf32_enabled,
)
from keras_mp.hardware.determinism import DeterminismReport, set_deterministic

__all__ = [
    "DeterminismReport",
    "Device",
    "HardwareReport",
    "cpu_features",
    "recommend",
    "report",
    "set_deterministic",
    "set_tf32",
    "tf32_enabled",
]
