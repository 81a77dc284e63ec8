"""Reading a run's state for `kmp.fingerprint`: variable summaries, metadata, values.

Private helpers of `keras_mp.fingerprint`. On the JAX backend `fit` keeps the state in
`model._jax_state` during an epoch (the model's variables are detached); `Source` reads
from there without syncing the model.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys

import keras
import numpy as np

__all__ = ["Source", "hash_all", "loss_entry", "replica_drift", "run_meta", "summarize"]

_SKETCH_CACHE: dict = {}
_ENV_KEYS = (
    "XLA_FLAGS",
    "TF_XLA_FLAGS",
    "TF_ENABLE_ONEDNN_OPTS",
    "TF_DETERMINISTIC_OPS",
    "TF_CUDNN_DETERMINISTIC",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
)


def _short(x: float) -> float:
    return float(f"{x:.8g}") if np.isfinite(x) else float(x)


def _buckets(n: int, m: int):
    key = (n, m)
    if key not in _SKETCH_CACHE:
        z = np.arange(n, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)  # splitmix64
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        buckets = (z % np.uint64(m)).astype(np.intp)
        signs = np.where(z >> np.uint64(63), -1.0, 1.0)
        if n <= 1 << 22:  # keep small ones (4M elements: 40 MB at most each)
            _SKETCH_CACHE[key] = (buckets, signs)
        return buckets, signs
    return _SKETCH_CACHE[key]


def summarize(value, sketch_size: int = 8) -> list:
    """The fingerprint of one variable's value: `[hash, mean, rms, max_abs, sketch]`.

    Args:
        value: an array (numpy or backend tensor).
        sketch_size: the number of sketch values.

    Returns:
        A list: 16 hex digits of blake2b over the dtype, shape and bytes; mean, RMS and
        max |x| in float64 (8 significant digits); the count sketch (float64).

    Example:

    >>> summarize(np.ones((2, 2), "float32"))[1:4]
    [1.0, 1.0, 1.0]
    """
    a = np.ascontiguousarray(keras.ops.convert_to_numpy(value))
    h = hashlib.blake2b(f"{a.dtype.name}{a.shape}".encode(), digest_size=8)
    h.update(a.tobytes())
    x = a.astype(np.float64).ravel()
    if x.size == 0:
        return [h.hexdigest(), 0.0, 0.0, 0.0, [0.0] * sketch_size]
    buckets, signs = _buckets(x.size, sketch_size)
    sketch = np.bincount(buckets, weights=signs * x, minlength=sketch_size)
    with np.errstate(all="ignore"):
        stats = [x.mean(), np.sqrt(np.mean(x * x)), np.abs(x).max()]
    return [h.hexdigest(), *(_short(s) for s in stats), [float(s) for s in sketch]]


def hash_all(values) -> str:
    h = hashlib.blake2b(digest_size=8)
    for v in values:
        a = np.ascontiguousarray(keras.ops.convert_to_numpy(v))
        h.update(f"{a.dtype.name}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, int, str)) or x is None:
        return x
    if isinstance(x, (float, np.floating)):
        return float(x)
    if isinstance(x, np.integer):
        return int(x)
    return repr(x)


def _optimizer_meta(opt) -> dict | None:
    if opt is None:
        return None
    inner = getattr(opt, "inner_optimizer", None)
    out = {"class": type(opt).__name__}
    try:
        config = opt.get_config()
    except Exception:  # a custom optimizer without get_config
        config = {}
    if inner is not None:
        out["inner"] = {"class": type(inner).__name__, **_jsonable(inner.get_config())}
        config = {k: v for k, v in config.items() if k != "inner_optimizer"}
    out.update(_jsonable(config))
    out.pop("name", None)
    if "inner" in out:
        out["inner"].pop("name", None)
    return out


def run_meta(model, opt, every_n_steps: int, sketch_size: int) -> dict:
    from keras_mp.hardware.determinism import last_report
    from keras_mp.version import __version__

    backend = keras.backend.backend()
    versions = {"keras": keras.__version__, "keras_mp": __version__}
    for name in ("tensorflow", "jax", "jaxlib", "torch"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    compute = sorted(
        {
            str(layer.dtype_policy.compute_dtype)
            for layer in model._flatten_layers()
            if layer.weights and getattr(layer, "dtype_policy", None) is not None
        }
    )
    meta = {
        "backend": backend,
        "versions": versions,
        "policy": keras.config.dtype_policy().name,
        "compute_dtypes": compute,
        "jit_compile": _jsonable(getattr(model, "jit_compile", None)),
        "optimizer": _optimizer_meta(opt),
        "every_n_steps": every_n_steps,
        "sketch_size": sketch_size,
        "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count()},
    }
    report = last_report()
    meta["deterministic"] = None if report is None else {"seed": report.seed}
    if backend == "tensorflow":
        from tensorflow.python.framework import config as tf_config

        meta["tf_op_determinism"] = bool(tf_config.is_op_determinism_enabled())
        strategy = getattr(model, "distribute_strategy", None)
        meta["replicas"] = int(getattr(strategy, "num_replicas_in_sync", 1))
    return meta


class Source:
    """Current values of the model's and optimizer's variables (the live JAX fit state first)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.variables = list(model.variables)
        self._where: dict | None = None

    def _state(self):
        state = getattr(self.model, "_jax_state", None)
        if state and not getattr(self.model, "_jax_state_synced", True):
            return state
        return None

    def _locate(self):
        if self._where is None:
            where = {}
            for kind, vs in (
                ("trainable_variables", self.model.trainable_variables),
                ("non_trainable_variables", self.model.non_trainable_variables),
                ("optimizer_variables", self.optimizer.variables if self.optimizer else []),
            ):
                for i, v in enumerate(vs):
                    where.setdefault(id(v), (kind, i))
            self._where = where
        return self._where

    def value(self, variable, state=None):
        state = state if state is not None else self._state()
        if state:
            kind, i = self._locate().get(id(variable), (None, None))
            values = state.get(kind) if kind else None
            if values:
                return values[i]
        return variable.value

    def model_values(self, state=None):
        return [self.value(v, state) for v in self.variables]

    def optimizer_values(self, state=None):
        if self.optimizer is None or not self.optimizer.built:
            return []
        return [self.value(v, state) for v in self.optimizer.variables]


def loss_entry(value):
    return None if value is None or not np.isfinite(value) else _short(value)


def replica_drift(model, variables) -> list:
    """Under a TensorFlow strategy: indices of the variables whose replicas disagree."""
    if keras.backend.backend() != "tensorflow":
        return []
    strategy = getattr(model, "distribute_strategy", None)
    if strategy is None or getattr(strategy, "num_replicas_in_sync", 1) <= 1:
        return []
    out = []
    for i, v in enumerate(variables):
        copies = [np.asarray(t) for t in strategy.experimental_local_results(v.value)]
        if any(c.tobytes() != copies[0].tobytes() for c in copies[1:]):
            out.append(i)
    return out
