"""A `.keras` file's archive, checked before Keras reads it: complete, undamaged, a model.

Keras reports a truncated archive as "File not found" and a damaged one with a
`zipfile.BadZipFile` traceback. `read_config` names the file and the problem instead. It
imports nothing from Keras, so the command line checks a file before it starts a backend.
"""

from __future__ import annotations

import json
import os
import zipfile

__all__ = ["read_config"]


def read_config(filepath: str | os.PathLike) -> dict:
    """The parsed `config.json` of the `.keras` archive `filepath`, after checking it.

    Args:
        filepath: Path to a `.keras` file.

    Returns:
        The model's serialized config.

    Raises:
        FileNotFoundError: `filepath` does not exist.
        ValueError: naming the file and the problem: a directory, not a zip file or
            truncated (its zip directory missing), a member failing its CRC check, no or
            unreadable `config.json`.

    Example:

    >>> keras_mp.keras_glue.archive.read_config("run/model.keras")["class_name"]  # doctest: +SKIP
    'Functional'
    """
    filepath = os.fspath(filepath)
    if not os.path.exists(filepath):
        raise FileNotFoundError(f"No such file: {filepath!r}.")
    if os.path.isdir(filepath):
        raise ValueError(f"{filepath!r} is a directory, not a .keras file.")
    size = os.path.getsize(filepath)
    if not zipfile.is_zipfile(filepath):
        raise ValueError(
            f"{filepath!r} ({size} bytes) is not a valid .keras archive: it is not a zip "
            "file, or it is truncated (its zip directory is missing). Re-save or re-copy it."
        )
    try:
        with zipfile.ZipFile(filepath) as archive:
            bad = archive.testzip()
            names = archive.namelist()
            raw = archive.read("config.json") if "config.json" in names else None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise ValueError(f"{filepath!r} ({size} bytes) is a corrupt .keras archive: {e}") from e
    if bad is not None:
        raise ValueError(
            f"{filepath!r} is a corrupt .keras archive: member {bad!r} fails its CRC check "
            "(the file was damaged after saving)."
        )
    if raw is None:
        raise ValueError(
            f"{filepath!r} is not a Keras model archive: it has no config.json (members: {names})."
        )
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{filepath!r}: config.json is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{filepath!r}: config.json holds no model config.")
    return config
