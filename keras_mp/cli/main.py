"""The `keras-mp` command line: `compare`, `audit`, `bench` and `doctor`.

Every command has `--help`. A bad argument or path prints one line on stderr and exits
with status 2 (no traceback); a model file that cannot be read (not a .keras archive,
truncated, damaged) exits with status 3. Arguments are parsed and checked before Keras is imported
(`keras_mp.cli.parser`); a command that needs the backend then starts it once, without the
backend's log lines (`keras_mp.cli.startup`; `--verbose` keeps them).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys

from keras_mp.cli import startup
from keras_mp.cli.parser import PROG, CLIError, build_parser, command

__all__ = ["CLIError", "build_parser", "main"]


def _rerun_under(backend: str, argv: list) -> int:
    """Keras' backend is fixed at import: run the same command in a fresh process."""
    env = dict(os.environ, KERAS_BACKEND=backend)
    return subprocess.call([sys.executable, "-m", "keras_mp_launcher", *argv], env=env)


def _without_backend(argv: list) -> list:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--backend":
            skip = True
        elif not arg.startswith("--backend="):
            out.append(arg)
    return out


def _select_backend(backend: str | None) -> bool:
    """Makes `backend` the Keras backend; False if Keras already runs another one here."""
    if backend is None:
        return True
    if importlib.util.find_spec(backend) is None:
        raise CLIError(f"--backend {backend}: {backend} is not installed.")
    if "keras" not in sys.modules:  # not imported yet: its backend is still ours to choose
        os.environ["KERAS_BACKEND"] = backend
        return True
    import keras

    return keras.backend.backend() == backend


def _run(args: argparse.Namespace, argv: list) -> int:
    cmd = command(args.command)
    if cmd.check is not None:
        cmd.check(args)
    if cmd.backend:
        if not _select_backend(args.backend):
            return _rerun_under(args.backend, _without_backend(argv))
        startup.start(verbose=args.verbose)
    return importlib.import_module(cmd.module).run(args)


def main(argv: list | None = None) -> int:
    """Entry point of the `keras-mp` script.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).

    Returns:
        The exit status: 0 on success, 2 on a usage error or a bad path/argument.

    Example:

    >>> from keras_mp.cli import main
    >>> main(["compare", "--epochs", "2", "--policies", "float32,mixed_bfloat16"])  # doctest: +SKIP
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        return _run(args, argv)
    except (CLIError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        name = f"{PROG} {argv[0]}" if argv and command(argv[0]) is not None else PROG
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{name}: error: {message}", file=sys.stderr)
        return getattr(e, "exit_status", 2)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
