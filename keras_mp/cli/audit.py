"""`keras-mp audit MODEL.keras [--data NPZ]`: print `kmp.audit`'s report for a saved model."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["load_batch", "run"]


def load_batch(path: str | None, model, batch: int = 32, seed: int = 0):
    """The audit batch: `x` and `y` from an `.npz`, or random inputs when `path` is None.

    Args:
        path: an `.npz` file with arrays `x` and (optionally) `y`; other names are accepted
            when the file holds exactly one or two arrays (taken as x, y in order).
        model: the model (for the input shape of random inputs).
        batch: number of samples to use.
        seed: seed of the random inputs.

    Returns:
        `x` or `(x, y)`.
    """
    if path is None:
        shape = model.inputs[0].shape[1:] if getattr(model, "inputs", None) else None
        if shape is None or any(d is None for d in shape):
            raise ValueError(
                f"--data: model {model.name!r} has no fixed input shape; pass a batch as .npz."
            )
        dtype = model.inputs[0].dtype
        rng = np.random.default_rng(seed)
        if "int" in str(dtype):
            return rng.integers(0, 2, size=(batch, *shape)).astype(dtype)
        return rng.standard_normal((batch, *shape)).astype("float32")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data: no such file: {path!r}")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"--data: {path!r} is not a readable .npz file ({e}).") from None
    if "x" in arrays:
        x, y = arrays["x"], arrays.get("y")
    elif 1 <= len(arrays) <= 2:
        x, *rest = arrays.values()
        y = rest[0] if rest else None
    else:
        raise ValueError(
            f"--data: {path!r} must hold arrays named 'x' (and 'y'); found {sorted(arrays)}."
        )
    x = x[:batch]
    return x if y is None else (x, y[:batch])


def _load(path: str):
    import keras

    import keras_mp  # noqa: F401  (registers keras_mp objects)

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model file: {path!r}")
    try:
        from keras_mp import saving

        return saving.load_model(path)
    except ImportError:  # pragma: no cover - keras_mp.saving is optional
        return keras.models.load_model(path)


def run(args) -> int:
    """Runs `keras-mp audit` from parsed arguments; returns the exit status."""
    for module in ("layers", "losses", "callbacks"):  # register their objects for loading
        __import__(f"keras_mp.{module}")
    try:
        from keras_mp.audit import audit
    except ImportError as e:  # pragma: no cover
        raise ValueError(f"kmp.audit is not available in this installation ({e}).") from None
    model = _load(args.model)
    data = load_batch(args.data, model)
    report = audit(model, data, loss_scale=args.loss_scale)
    if args.data is None:
        print("note: no --data given: random inputs, forward checks only.")
    print(report)
    return 0
