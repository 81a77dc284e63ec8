"""The `keras-mp` command line: `compare`, `audit`, `bench` and `doctor`.

Every command has `--help`. A bad argument or path prints one line on stderr and exits
with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

__all__ = ["CLIError", "build_parser", "main"]

PROG = "keras-mp"
_COMMANDS = ("compare", "audit", "bench", "doctor")


class CLIError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message and exits; one line instead
        raise CLIError(f"{message} (see `{self.prog} --help`)")


def _policies(text: str) -> tuple:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-mp` and its subcommands."""
    from keras_mp.cli.compare import DEFAULT_POLICIES, CompareConfig
    from keras_mp.cli.data import MODELS

    d = CompareConfig()
    parser = _Parser(
        prog=PROG,
        description="Mixed-precision training tools for Keras 3 (keras_mp).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    c = sub.add_parser(
        "compare",
        help="train one model under every precision mode and compare",
        description=(
            "Train one model under float32, mixed float16/bfloat16 and pure float16/bfloat16 "
            "(same seed, weights, batches and schedule) and print a table: validation "
            "accuracy and loss, speed, peak memory, skipped steps, loss scale and a verdict. "
            "Default: a BatchNorm CNN on scikit-learn's bundled digits."
        ),
    )
    c.add_argument("--model", choices=MODELS, default=d.model, help="model (default: %(default)s)")
    c.add_argument(
        "--policies",
        type=_policies,
        default=d.policies,
        help=f"comma-separated modes (default: {','.join(DEFAULT_POLICIES)})",
    )
    c.add_argument("--epochs", type=_positive(int), default=d.epochs, help="(default: %(default)s)")
    c.add_argument(
        "--batch-size", type=_positive(int), default=d.batch_size, help="(default: %(default)s)"
    )
    c.add_argument(
        "--lr",
        type=_positive(float),
        default=d.lr,
        help="peak learning rate (default: %(default)g)",
    )
    c.add_argument(
        "--optimizer",
        choices=("adam", "sgd"),
        default=d.optimizer,
        help="adam, or sgd with momentum 0.9 (default: %(default)s)",
    )
    c.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default=d.schedule,
        help="learning-rate schedule (default: %(default)s)",
    )
    c.add_argument(
        "--jit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force jit_compile on/off for every mode (default: XLA for float16 modes, which "
        "TensorFlow runs ~25x slower on CPU without it; Keras' default otherwise)",
    )
    c.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    c.add_argument(
        "--limit",
        type=_positive(int),
        default=None,
        help="train on only this many samples (quick runs)",
    )
    c.add_argument(
        "--out",
        default=os.path.join("runs", "compare"),
        help="directory for results.json and the plot (default: %(default)s)",
    )
    c.add_argument("--plot", action="store_true", help="write loss_curves.png to --out")
    c.add_argument("--no-progress", action="store_true", help="no progress bars")
    _backend_option(c)

    a = sub.add_parser(
        "audit",
        help="audit a saved model for mixed precision",
        description="Load MODEL (.keras) and print kmp.audit's per-layer report.",
    )
    a.add_argument("model", metavar="MODEL", help="path to a .keras model file")
    a.add_argument(
        "--data",
        metavar="NPZ",
        help="a .npz with arrays x and y (one batch); default: random inputs, forward checks only",
    )
    a.add_argument(
        "--loss-scale",
        type=_positive(float),
        default=None,
        help="loss scale for the gradient-underflow column",
    )
    _backend_option(a)

    sub.add_parser(
        "bench",
        help="time train steps under stock Keras and keras_mp policies (JSON lines); "
        "see `keras-mp bench --help`",
        add_help=False,
    )

    dr = sub.add_parser(
        "doctor",
        help="what this machine accelerates and which policy to use",
        description="Print kmp.hardware.report(): devices, supported low-precision formats "
        "and the recommended policy.",
    )
    _backend_option(dr)
    return parser


def _backend_option(p):
    p.add_argument(
        "--backend",
        choices=("tensorflow", "jax", "torch"),
        default=None,
        help="Keras backend to run under (default: KERAS_BACKEND or tensorflow)",
    )


def _rerun_under(backend: str, argv: list) -> int:
    """Keras' backend is fixed at import: run the same command in a fresh process."""
    env = dict(os.environ, KERAS_BACKEND=backend)
    return subprocess.call([sys.executable, "-m", "keras_mp.cli", *argv], env=env)


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


def _dispatch(args) -> int:
    if args.command == "compare":
        from keras_mp.cli.report import run

        return run(args)
    if args.command == "audit":
        from keras_mp.cli.audit import run

        return run(args)
    from keras_mp.cli.doctor import run

    return run(args)


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
            if argv[:1] == ["bench"]:  # the harness parses its own arguments
                from keras_mp.cli.bench import run

                return run(argv[1:])
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        if args.backend is not None:
            import importlib.util

            import keras

            if args.backend != keras.backend.backend():
                if importlib.util.find_spec(args.backend) is None:
                    raise CLIError(f"--backend {args.backend}: {args.backend} is not installed.")
                return _rerun_under(args.backend, _without_backend(argv))
        return _dispatch(args)
    except (CLIError, ValueError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
        command = f"{PROG} {argv[0]}" if argv and argv[0] in _COMMANDS else PROG
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
