"""Atomic saving: a checkpoint file is either the old one or the new one, never half of one.

Keras writes `.keras` and `.weights.h5` files in place (`open(path, "wb")`): a process
killed mid-write (`kill -9`, a pre-empted node, the OOM killer) leaves a truncated file
and the previous checkpoint is gone. `atomic_path()` gives the writer a temporary file in
the same directory (so the rename stays on one filesystem), named so that Keras accepts its
extension; when the writer returns, the file is flushed to disk (`fsync`), moved over the
destination with `os.replace` (atomic on POSIX and Windows) and the directory is flushed
so the rename itself survives a power cut. Any exception removes the temporary file and
leaves the destination untouched. The old file stays until the new one is complete, so a
save needs room for both: a full disk (or quota, or file-size limit) is an `OSError` that
says so, with the path and the bytes needed and free. Temporary files left by a killed
process (the same host, a process id no longer running) are removed at the next write to
the same path.
`save_model` and `save_weights` (also `kmp.saving.save_model` / `save_weights`) are
`model.save` and `model.save_weights` written this way.

The same recipe as `torch.save` to a temporary file + `os.replace`, and orbax's
write-to-temporary-then-rename checkpoints.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import glob
import io
import os
import re
import shutil
import socket
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import keras

__all__ = ["atomic_path", "remove_stale", "save_model", "save_weights", "temp_path"]

# Extensions Keras checks for: the longest first (".weights.h5" before ".h5").
_EXTENSIONS = (".weights.h5", ".weights.json", ".keras", ".h5", ".json")
_MARK = ".tmp-"


def _split_extension(path: str) -> tuple[str, str]:
    base = os.path.basename(path)
    for ext in _EXTENSIONS:
        if base.endswith(ext) and len(base) > len(ext):
            return base, ext
    return base, os.path.splitext(base)[1]


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def temp_path(filepath: str | os.PathLike) -> str:
    """The temporary file an atomic write of `filepath` goes to first.

    In the same directory, hidden, and ending with the same extension (Keras checks that a
    model file ends with `.keras` and a weights file with `.weights.h5`):
    `run/last.keras` -> `run/.last.keras.tmp-<host>-<pid>-<random>.keras`.

    Args:
        filepath: The destination.

    Returns:
        A path that does not exist yet.
    """
    filepath = os.fspath(filepath)
    base, ext = _split_extension(filepath)
    name = f".{base}{_MARK}{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}{ext}"
    return os.path.join(os.path.dirname(filepath), name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process (or no way to tell): leave its file alone
    return True


def remove_stale(filepath: str | os.PathLike) -> list[str]:
    """Removes the temporary files that killed writers of `filepath` left behind.

    Only files written from this host by a process that is no longer running are removed
    (on a shared filesystem another host's writer may still be busy with its own).

    Args:
        filepath: The destination whose temporary files to look for.

    Returns:
        The paths removed.
    """
    filepath = os.fspath(filepath)
    base, ext = _split_extension(filepath)
    pattern = os.path.join(
        glob.escape(os.path.dirname(filepath)), glob.escape(f".{base}{_MARK}{_host()}-") + "*"
    )
    prefix = f".{base}{_MARK}{_host()}-"
    removed = []
    for path in glob.glob(pattern):
        rest = os.path.basename(path)[len(prefix) :]
        match = re.fullmatch(r"(\d+)-[0-9a-f]{8}" + re.escape(ext), rest)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
            removed.append(path)
    return removed


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(dirname: str) -> None:
    if os.name == "nt":  # Windows cannot open a directory; NTFS journals the rename
        return
    fd = os.open(dirname or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (network mounts) refuse fsync on a directory
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(filepath: str | os.PathLike, overwrite: bool = True) -> Iterator[str]:
    """Yields a temporary path to write; on success it replaces `filepath` atomically.

    Args:
        filepath: The destination file. Its directory is created if missing.
        overwrite: If False and `filepath` exists, raise `FileExistsError` before writing.

    Yields:
        The temporary path (same directory, same extension) for the writer.

    Raises:
        FileExistsError: `overwrite=False` and `filepath` exists.
        IsADirectoryError: `filepath` is an existing directory.

    Example:

    >>> with atomic_path("run/last.keras") as tmp:  # doctest: +SKIP
    ...     model.save(tmp)
    """
    filepath = os.fspath(filepath)
    if os.path.isdir(filepath):
        raise IsADirectoryError(f"filepath={filepath!r} is a directory: give a file path.")
    if not overwrite and os.path.exists(filepath):
        raise FileExistsError(f"filepath={filepath!r} exists and overwrite=False.")
    dirname = os.path.dirname(filepath)
    if dirname:
        os.makedirs(dirname, exist_ok=True)
    remove_stale(filepath)
    tmp = temp_path(filepath)
    try:
        with _quiet_h5py_write_failures():
            yield tmp
        if not os.path.isfile(tmp):
            raise FileNotFoundError(f"The writer of {filepath!r} did not write {tmp!r}.")
        _fsync_file(tmp)
        os.replace(tmp, filepath)
    except OSError as e:
        written = _size(tmp)
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if e.errno in _NO_ROOM:
            raise _no_room(e, filepath, written) from e
        raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(dirname)


# ENOSPC (disk full), EDQUOT (quota), EFBIG (file size limit)
_NO_ROOM = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _no_room(error: OSError, filepath: str, written: int) -> OSError:
    """The error of a write that ran out of room, saying what an atomic save needs."""
    old = _size(filepath)
    dirname = os.path.dirname(os.path.abspath(filepath))
    try:
        free = f"{shutil.disk_usage(dirname).free:,} bytes are free"
    except OSError:
        free = "the free space is unknown"
    if old:
        need = (
            f"it writes the new file beside the old one ({old:,} bytes) and replaces the old "
            f"one only when the new one is complete, so it needs room for two copies: about "
            f"{old + max(old, written):,} bytes"
        )
    else:
        need = f"it needs room for the whole file (more than the {written:,} bytes written)"
    return type(error)(
        error.errno,
        f"Not enough room to save {filepath!r} ({os.strerror(error.errno)}): an atomic save "
        f"writes a temporary copy first; {need} in {dirname!r}, where {free}. The previous "
        "file is untouched and the partial copy was removed. Free some space, or save to "
        "another disk.",
    )


# What h5py (Cython) prints for each object it frees after a failed write: the traceback
# (to `sys.stderr`), then "Exception ignored in" (through `sys.unraisablehook`).
_H5PY_DEALLOC = re.compile(
    r"Traceback \(most recent call last\):\n  File \"h5py/_objects\.pyx\".*?"
    r"Can't decrement id ref count \(file write failed:.*?offset = \d+\)\n"
    r"|Exception ignored in: 'h5py\._objects\.ObjectID\.__dealloc__'\n",
    re.DOTALL,
)


@contextlib.contextmanager
def _quiet_h5py_write_failures():
    """Keeps h5py's tracebacks of a failed write (two per open object, printed as the file's
    objects are freed, each "ignored") off stderr: the write's own error is raised, and
    says more. Everything else the writer prints on stderr is printed, after it returns."""
    previous_hook, previous_stderr = sys.unraisablehook, sys.stderr
    captured = io.StringIO()

    def hook(unraisable):
        if "Can't decrement id ref count" not in str(unraisable.exc_value):
            previous_hook(unraisable)

    sys.unraisablehook, sys.stderr = hook, captured
    try:
        yield
    finally:
        gc.collect()  # the writer's h5py objects, freed while the filters are on
        sys.unraisablehook, sys.stderr = previous_hook, previous_stderr
        rest = _H5PY_DEALLOC.sub("", captured.getvalue())
        if rest:
            previous_stderr.write(rest)


def _is_remote(filepath: str) -> bool:
    return "://" in filepath


def save_model(
    model: keras.Model, filepath: str | os.PathLike, overwrite: bool = True, **kwargs: Any
) -> None:
    """`model.save`, atomically: `filepath` holds the old file or the new one, never half.

    The model is saved to a temporary file beside `filepath` (same directory and
    extension), flushed to disk, and moved over `filepath` with `os.replace`; the
    directory is flushed too. If saving raises, the temporary file is removed and
    `filepath` is untouched; temporary files of killed saves are removed by the next
    save. The file holds the optimizer's state (a `kmp.LossScaleOptimizer`'s scale and
    counters, a `kmp.LeanOptimizer`'s compact moments), so training resumes where it was.
    Paths with a scheme (`gs://...`) go straight to Keras.

    Args:
        model: The model to save.
        filepath: A `.keras` file (or a legacy `.h5` one).
        overwrite: If False and `filepath` exists, raise `FileExistsError` (Keras asks
            on the terminal instead).
        **kwargs: Passed on to `model.save`.

    Example:

    >>> kmp.saving.save_model(model, "run/last.keras")  # doctest: +SKIP
    """
    import keras_mp.saving.plan as load_plan

    filepath = os.fspath(filepath)
    with load_plan.scope():  # a converted Functional model's config keeps its plan
        if _is_remote(filepath):
            model.save(filepath, overwrite=overwrite, **kwargs)
            return
        with atomic_path(filepath, overwrite=overwrite) as tmp:
            model.save(tmp, overwrite=True, **kwargs)


def save_weights(model: keras.Model, filepath: str | os.PathLike, overwrite: bool = True) -> None:
    """`model.save_weights`, atomically (see `save_model`).

    Args:
        model: The model whose weights (and its optimizer's variables) to save.
        filepath: A `.weights.h5` file.
        overwrite: If False and `filepath` exists, raise `FileExistsError`.

    Example:

    >>> kmp.saving.save_weights(model, "run/last.weights.h5")  # doctest: +SKIP
    """
    filepath = os.fspath(filepath)
    if not filepath.endswith(".weights.h5"):
        raise ValueError(f"filepath={filepath!r} must end in `.weights.h5`.")
    if _is_remote(filepath):
        model.save_weights(filepath, overwrite=overwrite)
        return
    with atomic_path(filepath, overwrite=overwrite) as tmp:
        model.save_weights(tmp, overwrite=True)
