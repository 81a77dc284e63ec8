"""Run fingerprints: a small JSON record of a training run, and a diff that classifies.

The face of the subpackage (`kmp.fingerprint`): the `Fingerprint` callback and `Recorder`
(`recorder.py`), reading a run's state (`state.py`), and `diff` with its classification
of the difference (`diff.py`, `classify.py`). The rounding bound is derived in
`recorder.py` and docs/reproducibility.md.
"""

from keras_mp.fingerprint.recorder import (
    LOSS_FACTOR,
    ROUNDING_FACTOR,
    DiffReport,
    Fingerprint,
    FingerprintError,
    Recorder,
    diff,
    load,
    summarize,
)

__all__ = [
    "DiffReport",
    "Fingerprint",
    "FingerprintError",
    "LOSS_FACTOR",
    "ROUNDING_FACTOR",
    "Recorder",
    "diff",
    "load",
    "summarize",
]
