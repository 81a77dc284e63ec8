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

__all__ = ["EXTRAS", "MissingExtraError", "install_command", "installed", "require"]

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
