"""TensorFlow's, absl's and XLA's C++ log lines: recognising them, and hiding them.

TensorFlow writes C++ log lines to stderr (oneDNN, CUDA stubs, CPU features, "failed call
to cuInit" on a machine without a GPU, XLA compilation). Some are written before
TensorFlow reads `TF_CPP_MIN_LOG_LEVEL`, so the level alone cannot hide them:
`captured_stderr` captures file descriptor 2 around the code that writes them and passes on
every line that is not a log line below the level. Used by the `keras-mp` command
(`keras_mp.cli.startup`) and by `import keras_mp` where it is what imports TensorFlow
(`keras_mp.keras_glue.patches`).

Nothing here imports Keras or a backend.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = [
    "LOG_LEVEL_VARIABLE",
    "captured_stderr",
    "is_backend_log",
    "log_level",
    "strip_backend_logs",
]

LOG_LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
# absl's prefix: severity, MMDD, time, thread id, file:line]
_LOG_LINE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^\s\]]+:\d+\] ")
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called"
# Lines that only mean "no CUDA GPU here": not errors (`keras-mp doctor` says so plainly).
_NO_GPU = ("failed call to cuInit", "Could not find cuda drivers")


def log_level(environ=None) -> int:
    """The `TF_CPP_MIN_LOG_LEVEL` in `environ` (default `os.environ`): 0 to 3, 0 if unset."""
    text = (os.environ if environ is None else environ).get(LOG_LEVEL_VARIABLE, "0")
    try:
        return min(max(int(text), 0), 3)
    except ValueError:
        return 0


def is_backend_log(line: str, level: int) -> bool:
    """Whether `line` is a TensorFlow/absl/XLA C++ log line hidden at `level`.

    Args:
        line: one line of stderr.
        level: a `TF_CPP_MIN_LOG_LEVEL` (0: info and up shown, 3: only fatal ones).

    Returns:
        True for a log line below `level`, for absl's "All log messages before
        absl::InitializeLog()" banner, and for the lines that only say there is no CUDA
        GPU, when `level` is at least 1; False otherwise.
    """
    if level < 1:
        return False
    if line.startswith(_ABSL_BANNER):
        return True
    match = _LOG_LINE.match(line)
    if match is None:
        return False
    return _SEVERITY[line[0]] < level or any(text in line for text in _NO_GPU)


def strip_backend_logs(text: str, level: int | None = None) -> str:
    """`text` without the lines `is_backend_log` hides at `level` (default: `log_level()`)."""
    level = log_level() if level is None else level
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not is_backend_log(line, level))


@contextlib.contextmanager
def captured_stderr(level: int | None) -> Iterator[None]:
    """Captures file descriptor 2 inside; passes on what `strip_backend_logs` keeps.

    C++ libraries write to the file descriptor, not to `sys.stderr`. On an exception,
    everything captured is passed on.

    Args:
        level: the log level to filter at; None captures nothing.
    """
    if level is None:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to capture
        yield
        return
    failed = False
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            text = text if failed else strip_backend_logs(text, level)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()
