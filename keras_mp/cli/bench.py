"""`keras-mp bench`: the performance harness, `keras_mp.cli.benchmark`, behind the CLI.

Every argument after `bench` goes to the harness (see `keras-mp bench --help`); argument
errors come back as one line and exit status 2 like the other commands.
"""

from __future__ import annotations

__all__ = ["run"]


def run(argv: list) -> int:
    """Runs the harness with `argv` (the arguments after `bench`); returns the exit status."""
    from keras_mp.cli import benchmark
    from keras_mp.cli.main import CLIError

    parser = benchmark.build_parser()

    def error(message):
        raise CLIError(f"{message} (see `keras-mp bench --help`)")

    parser.error = error
    parser.parse_args(argv)  # usage errors as one line, before any work; --help exits 0
    return benchmark.main(argv)
