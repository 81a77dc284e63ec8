"""`keras-mp fit`: the former name of `keras-mp memory` (`keras_mp.cli.memory`), kept as an alias.

The name read as `model.fit`; the command estimates a train step's memory. `keras-mp fit`
runs `keras-mp memory` with the same arguments, and this module's names are that module's.
"""

from __future__ import annotations

from keras_mp.cli.memory import (
    COMPARE_MODELS,
    DESCRIPTION,
    HELP,
    MODELS,
    POLICIES,
    WORKLOAD_MODELS,
    add_arguments,
    check,
    run,
)

__all__ = [
    "COMPARE_MODELS",
    "DESCRIPTION",
    "HELP",
    "MODELS",
    "POLICIES",
    "WORKLOAD_MODELS",
    "add_arguments",
    "check",
    "run",
]
