"""`keras-mp diff A.json B.json`: are two training runs the same, up to rounding, or not?

Reads two fingerprints written by `kmp.fingerprint.Fingerprint` (or `Recorder.save`) and
prints `kmp.fingerprint.diff`'s report. Exit status: 0 identical or same up to rounding,
1 diverged, 2 bad input (missing file, corrupt JSON, fingerprints of different models),
with a one-line error. Needs numpy only: no backend starts.
"""

from __future__ import annotations

import argparse
import json
import os

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "check", "run"]

HELP = "compare two runs' fingerprints: identical, rounding, or diverged (where, why)"
DESCRIPTION = (
    "Compare two fingerprints written by kmp.fingerprint.Fingerprint and say whether the runs "
    "are identical, the same trajectory up to rounding (distance vs the rounding bound), or "
    "diverged: at which step, first in which variable, and the likely cause. Exit status 0 "
    "(identical or rounding), 1 (diverged), 2 (bad input)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds `diff`'s arguments to its parser."""
    p.add_argument("a", metavar="A.json", help="the first run's fingerprint")
    p.add_argument("b", metavar="B.json", help="the second run's fingerprint")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def check(args: argparse.Namespace) -> None:
    """Fails early, in one line, on paths that are not files."""
    for path in (args.a, args.b):
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such fingerprint file: {path!r}")
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path!r} is a directory, not a fingerprint file")


def run(args: argparse.Namespace) -> int:
    """Prints the report; returns 0 (identical/rounding) or 1 (diverged)."""
    from keras_mp.fingerprint.diff import diff

    report = diff(args.a, args.b)  # FingerprintError (a ValueError): one line, status 2
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 1 if report.verdict == "diverged" else 0
