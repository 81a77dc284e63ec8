"""The `keras-mp` command line (`compare`, `audit`, `bench`, `doctor`).

Run `keras-mp --help`, or call `keras_mp.cli.main(["compare", "--epochs", "2"])` from Python
(it returns the exit status).
"""

from keras_mp.cli.main import main

__all__ = ["main"]
