"""The `keras-mp` subcommands and their arguments: `COMMANDS` declares them all.

Imports nothing heavy: `keras-mp --help` and argument errors never start a backend. To add a
subcommand, write `keras_mp/cli/NAME.py` with `run(args) -> int`, a function adding its
arguments here, and a `Command` in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

from keras_mp.cli import diff as _diff
from keras_mp.cli import memory as _memory
from keras_mp.cli.errors import CLIError

__all__ = ["COMMANDS", "PROG", "CLIError", "Command", "build_parser", "command"]

PROG = "keras-mp"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + message and exits; one line instead
        raise CLIError(f"{message} (see `{self.prog} --help`)")


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand of `keras-mp`.

    Attributes:
        name: what the user types.
        module: the module whose `run(args) -> int` runs it; imported only to run it.
        help: one line for `keras-mp --help`.
        description: the text of `keras-mp NAME --help`.
        arguments: adds the subcommand's arguments to its parser; optional.
        check: checks parsed arguments before any backend starts (raises `ValueError`,
            `FileNotFoundError` or `CLIError` with a one-line message); optional.
        backend: True: keras_mp, Keras and its backend start (once, quietly) before `run`,
            and the subcommand takes `--backend`; False: `run` starts what it needs.
    """

    name: str
    module: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    check: Callable[[argparse.Namespace], None] | None = None
    backend: bool = True


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


def _policies(text: str) -> tuple:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _compare_arguments(c: argparse.ArgumentParser) -> None:
    from keras_mp.cli.settings import (
        DEFAULT_POLICIES,
        MODELS,
        POLICIES,
        T5_POLICIES,
        CompareConfig,
    )

    d = CompareConfig()
    c.add_argument("--model", choices=MODELS, default=d.model, help="model (default: %(default)s)")
    c.add_argument(
        "--policies",
        type=_policies,
        default=None,
        help=f"comma-separated modes, from {','.join(POLICIES)}, or lean variants "
        "lean_bfloat16:ROUNDING:MOMENTS (e.g. lean_bfloat16:stochastic:int4) (default: "
        f"{','.join(DEFAULT_POLICIES)}; with --model t5: {','.join(T5_POLICIES)})",
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
        "TensorFlow runs several times slower on CPU without it; Keras' default otherwise)",
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


def _check_compare(args: argparse.Namespace) -> None:
    from keras_mp.cli.settings import config_from_args

    config_from_args(args)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out: {args.out!r} exists and is not a directory.")


def _audit_arguments(a: argparse.ArgumentParser) -> None:
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
    a.add_argument(
        "--fix",
        metavar="OUT",
        help="write MODEL converted under --policy, calibrated on --data, to OUT (.keras)",
    )
    a.add_argument(
        "--policy",
        choices=("mixed_float16", "mixed_bfloat16"),
        default="mixed_float16",
        help="policy of --fix (default: %(default)s)",
    )
    a.add_argument(
        "--margin",
        type=_positive(float),
        default=4.0,
        help="calibration's safety factor: pin what passes the dtype's max / margin "
        "(default: %(default)g)",
    )
    a.add_argument(
        "--max-samples",
        type=_positive(int),
        default=None,
        help="audit only the first N samples of --data (default: all of them; the verdict "
        "line says how many were used)",
    )
    a.add_argument("--no-progress", action="store_true", help="no progress bar")


def _check_audit(args: argparse.Namespace) -> None:
    if not os.path.exists(args.model):
        raise FileNotFoundError(f"no such model file: {args.model!r}")
    if args.data is not None and not os.path.isfile(args.data):
        raise FileNotFoundError(f"--data: no such file: {args.data!r}")
    if args.fix is not None:
        if args.data is None:
            raise CLIError("--fix calibrates on your data: give it with --data FILE.npz")
        if not args.fix.endswith(".keras"):
            raise CLIError(f"--fix: {args.fix!r} must end in .keras")
        if args.margin < 1:
            raise CLIError(f"--margin must be >= 1, got {args.margin:g}")


def _bench_arguments(b: argparse.ArgumentParser) -> None:
    from keras_mp.cli import benchmark

    benchmark.add_arguments(b)
    b.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line per configuration on stdout (progress, table and verdict "
        "go to stderr)",
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bars")


COMMANDS = (
    Command(
        name="compare",
        module="keras_mp.cli.report",
        help="train one model under every precision mode and compare",
        description=(
            "Train one model under float32, mixed float16/bfloat16 and pure float16/bfloat16 "
            "(same seed, weights, batches and schedule) and print a table: validation "
            "accuracy and loss, speed, peak memory, skipped steps, loss scale and a verdict. "
            "Default: a BatchNorm CNN on scikit-learn's bundled digits."
        ),
        arguments=_compare_arguments,
        check=_check_compare,
    ),
    Command(
        name="audit",
        module="keras_mp.cli.audit",
        help="audit a saved model for mixed precision",
        description="Load MODEL (.keras) and print kmp.audit's per-layer report and its verdict. "
        "With --fix OUT and --data, also write the model converted under --policy with the "
        "layers that overflow the compute dtype on that data pinned to float32.",
        arguments=_audit_arguments,
        check=_check_audit,
    ),
    Command(
        name="bench",
        module="keras_mp.cli.bench",
        help="time train steps under stock Keras and keras_mp policies",
        description=(
            "Time train steps of GPT / ResNet-50 workloads under stock Keras and keras_mp "
            "precision policies, one subprocess per configuration, and print a table and "
            "the fastest low-precision row of each model. --out and --json keep one JSON "
            "record per configuration."
        ),
        arguments=_bench_arguments,
        backend=False,
    ),
    Command(
        name="doctor",
        module="keras_mp.cli.doctor",
        help="what this machine accelerates and which policy to use",
        description="Print kmp.hardware.report(): devices, supported low-precision formats "
        "and the recommended policy.",
    ),
    Command(
        name="memory",
        module="keras_mp.cli.memory",
        help=_memory.HELP,
        description=_memory.DESCRIPTION,
        arguments=_memory.add_arguments,
        check=_memory.check,
    ),
    Command(  # the former name of `memory`, kept as an alias
        name="fit",
        module="keras_mp.cli.memory",
        help="the former name of `memory` (an alias)",
        description="The former name of `keras-mp memory`, with the same arguments: "
        + _memory.DESCRIPTION,
        arguments=_memory.add_arguments,
        check=_memory.check,
    ),
    Command(
        name="diff",
        module="keras_mp.cli.diff",
        help=_diff.HELP,
        description=_diff.DESCRIPTION,
        arguments=_diff.add_arguments,
        check=_diff.check,
        backend=False,
    ),
)


def command(name: str) -> Command | None:
    """The `Command` called `name`, or None."""
    return next((c for c in COMMANDS if c.name == name), None)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `keras-mp` and its subcommands (from `COMMANDS`)."""
    parser = _Parser(
        prog=PROG,
        description="Mixed-precision training tools for Keras 3 (keras_mp).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description)
        if cmd.arguments is not None:
            cmd.arguments(p)
        if cmd.backend:
            p.add_argument(
                "--backend",
                choices=("tensorflow", "jax", "torch"),
                default=None,
                help="Keras backend to run under (default: KERAS_BACKEND or tensorflow)",
            )
        p.add_argument(
            "--verbose",
            action="store_true",
            help="keep TensorFlow/absl/XLA log lines (hidden by default unless "
            "TF_CPP_MIN_LOG_LEVEL is set)",
        )
    return parser
