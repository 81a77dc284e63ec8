"""keras_mp's record line: one JSON object per line, printed and appended to a file.

Imports nothing heavy: `keras-mp bench`'s parent process writes its records without
starting Keras (its configurations run in subprocesses).
"""

from __future__ import annotations

import json

__all__ = ["emit"]


def emit(record: dict, out: str | None = None, echo: bool = True) -> None:
    """Prints `record` as one JSON line (unless `echo=False`) and appends it to the file
    `out` (if given): the record format of the harness and the benchmark scripts."""
    line = json.dumps(record)
    if echo:
        print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
