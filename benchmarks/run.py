"""Runs the keras_mp performance harness (`keras_mp/cli/benchmark.py`; also `keras-mp bench`).

Examples:

    python benchmarks/run.py --models cpu_gpt,cpu_resnet --out results.jsonl
    KERAS_BACKEND=jax python benchmarks/run.py --backend jax --models gpt,resnet50
    python benchmarks/run.py --help

Each configuration runs in its own subprocess and prints one JSON line; a Markdown table of
the run goes to stderr at the end. See benchmarks/BENCHMARKS.md for published figures.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keras_mp.cli.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
