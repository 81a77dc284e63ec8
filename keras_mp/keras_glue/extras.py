"""Optional dependencies: which feature needs which package, and how to install it.

keras_mp needs Keras and one backend. TensorFlow and JAX are extras, as in Keras itself:
`pip install "keras_mp[tensorflow]"` for the TensorFlow backend and the TensorFlow-only
features (SavedModel export, the `tf.distribute` helpers), `pip install "keras_mp[jax]"`
for the JAX backend and the memory estimate (`kmp.estimate_memory`, `keras-mp memory`),
which only JAX's compiler computes. A feature called without its package raises
`MissingExtraError` (an `ImportError`) naming the command that installs it.

Nothing here imports a backend: whether a package is installed is asked without loading it.

Example:

```python
from keras_mp.keras_glue.extras import require

require("jax", "kmp.estimate_memory")   # raises MissingExtraError when JAX is absent
```
"""

from __future__ import annotations

import importlib.util
import json
import os

__all__ = [
    "EXTRAS",
    "MissingExtraError",
    "configured_backend",
    "install_command",
    "installed",
    "missing_backend",
    "require",
]

# module -> the keras_mp extra that installs it
EXTRAS = {"jax": "jax", "tensorflow": "tensorflow"}
_ACCELERATED = {
    "jax": 'on an NVIDIA GPU install JAX\'s CUDA build instead: pip install "jax[cuda12]"',
    "tensorflow": 'on an NVIDIA GPU: pip install "tensorflow[and-cuda]>=2.21,<2.22"',
}


class MissingExtraError(ImportError):
    """A keras_mp feature was called without the optional package it needs."""


def installed(module: str) -> bool:
    """Whether `module` can be imported (it is not imported to find out).

    Args:
        module: a top-level module name, e.g. `"jax"`.

    Returns:
        A bool; False also where the module was blocked (`sys.modules[module] = None`).
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-imported package
        return False


def install_command(module: str) -> str:
    """The command that installs `module` with keras_mp, e.g. `pip install "keras_mp[jax]"`."""
    extra = EXTRAS.get(module)
    return f'pip install "keras_mp[{extra}]"' if extra else f"pip install {module}"


def require(module: str, feature: str) -> None:
    """Raises `MissingExtraError` when `module` is not installed.

    Args:
        module: the package `feature` needs (`"jax"` or `"tensorflow"`).
        feature: what the user called, in words (e.g. `"kmp.estimate_memory"`), named in
            the message.

    Raises:
        MissingExtraError: naming `feature`, `module` and the command that installs it.
    """
    if installed(module):
        return
    hint = _ACCELERATED.get(module)
    raise MissingExtraError(
        f"{feature} needs {module}, which is not installed: {install_command(module)}"
        + (f" ({hint})." if hint else "."),
        name=module,
    )


def configured_backend(environ=None) -> str:
    """The backend Keras will start, read as Keras reads it, without importing Keras:
    `KERAS_BACKEND`, else `keras.json`'s `"backend"` (in `KERAS_HOME` or `~/.keras`),
    else `"tensorflow"`."""
    environ = os.environ if environ is None else environ
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    home = environ.get("KERAS_HOME")
    if not home:
        base = os.path.expanduser("~")
        home = os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return str(json.load(f).get("backend") or "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


def missing_backend(backend: str | None = None, environ=None, flag: str = "KERAS_BACKEND"):
    """Why Keras cannot start `backend` (default: the configured one), in one line, or None.

    keras_mp installs no backend of its own, so after `pip install "keras_mp[jax]"` Keras
    still starts TensorFlow unless `KERAS_BACKEND` says otherwise, and dies in its import.

    Args:
        backend: the backend asked for, or None for `configured_backend(environ)`.
        environ: the environment (default `os.environ`).
        flag: how the user chooses the backend, named in the message (`--backend` on the
            command line).

    Returns:
        None when it is installed, else a message naming what to set or install.
    """
    environ = os.environ if environ is None else environ
    name = backend or configured_backend(environ)
    if installed(name):
        return None
    if backend is not None:
        source = flag
    elif environ.get("KERAS_BACKEND"):
        source = "KERAS_BACKEND"
    elif name != "tensorflow":
        source = "keras.json"
    else:
        source = "Keras' default: KERAS_BACKEND is unset"
    others = [b for b in ("jax", "tensorflow", "torch") if b != name and installed(b)]
    message = f"the Keras backend {name!r} ({source}) is not installed: "
    if others:
        value = f"pass {flag} {others[0]}" if flag.startswith("-") else f"set {flag}={others[0]}"
        message += f"{value} ({others[0]} is installed), or {install_command(name)}"
    else:
        message += f"{install_command(name)} (or another backend: jax, torch)"
    return message + "."
