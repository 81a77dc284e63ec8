"""Entry point of the `keras-mp` script: the command line starts without importing Keras.

`import keras_mp` imports Keras and its backend (TensorFlow by default: several seconds)
because it registers keras_mp's serializable objects. `keras-mp --help`, argument errors
and `bench`'s parent process need none of that, so `main` puts the `keras_mp` package into
`sys.modules` with its `__init__` not yet run: its submodules (`keras_mp.cli.*`) import as
usual, and the package's `__init__` runs the first time one of its attributes is used
(`keras_mp.convert`, `from keras_mp import losses`, ...), which is when a command starts the
backend. A `keras_mp` that is already imported is used as it is.
"""

from __future__ import annotations

import importlib.util
import sys

__all__ = ["defer_package_init", "main"]


def defer_package_init(name: str = "keras_mp") -> None:
    """Makes `import name` cheap until one of the package's attributes is used.

    Args:
        name: a top-level package, not imported yet (nothing is done if it is).
    """
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return  # not an installed package: the import reports it
    package = importlib.util.module_from_spec(spec)  # `__path__` set, `__init__` not run

    def __getattr__(attribute):  # noqa: N807 - PEP 562 module `__getattr__`
        del package.__dict__["__getattr__"]  # once: missing names then fail normally
        try:
            spec.loader.exec_module(package)
        except BaseException:
            sys.modules.pop(name, None)  # as a failed import: the next `import` retries
            raise
        return getattr(package, attribute)

    package.__getattr__ = __getattr__
    sys.modules[name] = package


def main() -> int:
    """Runs `keras-mp` with `sys.argv`; returns the exit status."""
    defer_package_init()
    from keras_mp.cli.main import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
