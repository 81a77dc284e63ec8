"""Starting Keras and its backend for a `keras-mp` command: once, and without log noise.

TensorFlow, absl and XLA write C++ log lines to stderr (oneDNN, CUDA stubs, CPU features,
"failed call to cuInit" on a machine without a GPU, XLA compilation) that tell a user of the
command line nothing. Unless the user set `TF_CPP_MIN_LOG_LEVEL` or passes `--verbose`,
`quiet_environment` raises that level before the backend loads. Some lines are written
before TensorFlow applies the level, so `start` imports the backend and lists its devices
with stderr captured, and passes on every captured line that is not a log line below the
level (`keras_mp.keras_glue.backend_logs`). A user-set level is respected the same way.

Nothing here imports Keras at module level.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys

from keras_mp.keras_glue.backend_logs import (
    LOG_LEVEL_VARIABLE,
    captured_stderr,
    is_backend_log,
    log_level,
    strip_backend_logs,
)

__all__ = [
    "LOG_LEVEL_VARIABLE",
    "QUIET_ENVIRONMENT",
    "captured_stderr",
    "check_backend_installed",
    "configured_backend",
    "is_backend_log",
    "log_level",
    "quiet_environment",
    "quiet_python_loggers",
    "start",
    "strip_backend_logs",
]

# Set when the user has not set them: TF/XLA C++ logs up to ERROR hidden, gRPC quiet.
QUIET_ENVIRONMENT = {LOG_LEVEL_VARIABLE: "3", "GRPC_VERBOSITY": "ERROR"}
_PYTHON_LOGGERS = ("tensorflow", "absl", "jax._src.xla_bridge")


def quiet_environment(verbose: bool = False, environ=None) -> int | None:
    """Sets the quiet defaults of `QUIET_ENVIRONMENT` the user has not set.

    Args:
        verbose: True leaves the environment as it is.
        environ: the environment to change (default `os.environ`).

    Returns:
        The C++ log level to filter captured stderr at (`log_level`), or None when
        `verbose` (nothing is filtered).
    """
    if verbose:
        return None
    environ = os.environ if environ is None else environ
    for key, value in QUIET_ENVIRONMENT.items():
        environ.setdefault(key, value)
    return log_level(environ)


class _QuietFirstImport(importlib.abc.MetaPathFinder):
    """Finds module `name` as usual, once; its import then runs with stderr captured.

    With the JAX or PyTorch backend Keras may still import TensorFlow later (e.g.
    `keras.utils.set_random_seed` seeds it when it is installed), and TensorFlow prints its
    first log lines while it loads.
    """

    def __init__(self, name: str, level: int):
        self.name, self.level = name, level

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; the other finders answer the lookup below
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module  # this spec's own loader instance

        def exec_module(module):
            try:
                with captured_stderr(self.level):
                    execute(module)
            finally:
                del loader.exec_module

        loader.exec_module = exec_module
        return spec


def quiet_python_loggers() -> None:
    """TensorFlow's, absl's and JAX's platform Python loggers: errors only."""
    for name in _PYTHON_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def _list_devices(backend: str) -> None:
    # The first device query is where TensorFlow and JAX look for CUDA and log about it.
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.list_physical_devices()
    elif backend == "jax":
        import jax

        jax.devices()


def configured_backend(environ=None) -> str:
    """The backend Keras will start (`keras_mp.keras_glue.extras.configured_backend`)."""
    from keras_mp.keras_glue.extras import configured_backend as configured

    return configured(environ)


def check_backend_installed(environ=None, backend: str | None = None) -> None:
    """Raises `ValueError` (one line: what to install, or `--backend` to pass) when the
    backend Keras would start (or `backend`, a `--backend` value) is not installed;
    nothing when Keras is already imported.

    keras_mp installs no backend of its own (TensorFlow and JAX are its extras), so
    `keras-mp compare` after `pip install keras_mp` alone would die in Keras' import.
    """
    if "keras" in sys.modules and backend is None:
        return
    from keras_mp.keras_glue.extras import missing_backend

    message = missing_backend(backend, environ, flag="--backend")
    if message:
        raise ValueError(message)


def start(verbose: bool = False) -> str:
    """Imports keras_mp (which registers its objects) with Keras and its backend, quietly.

    The backend is the one `KERAS_BACKEND` names (or Keras' configured default); it is
    imported once, here, and its devices are listed. When that backend is not TensorFlow,
    a later import of TensorFlow is captured the same way.

    Args:
        verbose: True keeps the backend's own logging as the environment sets it.

    Returns:
        The Keras backend's name.

    Raises:
        ValueError: the backend Keras would start is not installed (what to install).
    """
    check_backend_installed()
    level = quiet_environment(verbose)
    if not verbose:
        quiet_python_loggers()
    with captured_stderr(level):
        import keras

        import keras_mp

        keras_mp.__version__  # noqa: B018 - runs the package's init if the launcher deferred it
        backend = keras.backend.backend()
        _list_devices(backend)
    if level is not None and "tensorflow" not in sys.modules:
        if importlib.util.find_spec("tensorflow") is not None:
            sys.meta_path.insert(0, _QuietFirstImport("tensorflow", level))
    if not verbose:
        quiet_python_loggers()  # again: a backend may configure its logger when imported
    return backend
