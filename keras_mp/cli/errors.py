"""The command line's user errors: one line on stderr, and the exit status they carry."""

from __future__ import annotations

__all__ = ["CLIError", "UnreadableModelError"]


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""

    exit_status = 2


class UnreadableModelError(CLIError):
    """A model file that cannot be read (not a .keras archive, damaged, truncated): one
    line, exit status 3 (distinct from a command's own 1, e.g. `memory`'s "does not fit")."""

    exit_status = 3
