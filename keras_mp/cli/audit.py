"""`keras-mp audit MODEL.keras [--data NPZ] [--fix OUT.keras]`: `kmp.audit`'s report.

A progress bar while the model loads and the audit probes it, the report, then one verdict
line. With `--fix`, the model converted under `--policy` and calibrated on `--data`
(`kmp.convert(..., calibrate=...)`) is written to OUT and its plan printed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np

from keras_mp.cli.errors import UnreadableModelError
from keras_mp.keras_glue.archive import read_config

__all__ = ["fix", "load_batch", "run", "verdict"]


def load_batch(path: str | None, model, batch: int = 32, seed: int = 0, limit: int | None = None):
    """The audit batch: `x` and `y` from an `.npz`, or random inputs when `path` is None.

    Args:
        path: an `.npz` file with arrays `x` and (optionally) `y`; other names are accepted
            when the file holds exactly one or two arrays (taken as x, y in order).
        model: the model (for the input shape of random inputs).
        batch: number of random samples (without `path`).
        seed: seed of the random inputs.
        limit: the most samples taken from the file (its first ones); None: all of them.

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
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):  # a .npy file: the inputs alone
            arrays = {"x": loaded}
        else:
            with loaded as f:
                arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"--data: {path!r} is not a readable .npz or .npy file ({e}).") from None
    if "x" in arrays:
        x, y = arrays["x"], arrays.get("y")
    elif 1 <= len(arrays) <= 2:
        x, *rest = arrays.values()
        y = rest[0] if rest else None
    else:
        raise ValueError(
            f"--data: {path!r} must hold arrays named 'x' (and 'y'); found {sorted(arrays)}."
        )
    _check_width(path, x, model)
    return _first(x if y is None else (x, y), limit)


def _check_width(path: str, x, model) -> None:
    """Raises naming `--data` when `x` does not fit the model's (single) input."""
    specs = list(getattr(model, "inputs", None) or [])
    if len(specs) != 1 or not hasattr(x, "shape"):
        return
    want = tuple(specs[0].shape[1:])
    got = tuple(x.shape[1:])
    if len(got) != len(want) or any(w is not None and w != g for w, g in zip(want, got)):
        raise ValueError(
            f"--data: {path!r} holds inputs of shape {tuple(x.shape)} (samples, "
            f"{', '.join(map(str, got))}), but model {model.name!r} takes (batch, "
            f"{', '.join(map(str, want))}): pass a batch of the model's inputs."
        )


def _first(data, limit: int | None):
    """The first `limit` samples of `x` or `(x, y)` (all when None)."""
    if limit is None:
        return data
    return tuple(a[:limit] for a in data) if isinstance(data, tuple) else data[:limit]


def _samples(data) -> int:
    x = data[0] if isinstance(data, tuple) else data
    return len(x)


def _load(path: str):
    import keras

    import keras_mp  # noqa: F401  (registers keras_mp objects)

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such model file: {path!r}")
    if os.path.isdir(path):
        raise UnreadableModelError(
            f"{path!r} is a directory: give a .keras model file (or a legacy .h5 one); a "
            "TensorFlow SavedModel cannot be audited (Keras 3 loads it for inference only, as "
            "keras.layers.TFSMLayer)."
        )
    if path.endswith(".keras"):
        try:
            read_config(path)
        except ValueError as e:
            raise UnreadableModelError(str(e)) from None
    elif not path.endswith(".h5"):
        raise UnreadableModelError(
            f"{path!r} is not a model file Keras reads: give a .keras file (or a legacy .h5)."
        )
    try:
        import keras_mp.saving as saving

        return saving.load_model(path)
    except ImportError:  # pragma: no cover - keras_mp.saving is optional
        return keras.models.load_model(path)


def verdict(
    report, path: str, forward_only: bool, samples: int | None = None, given: int | None = None
) -> str:
    """The closing line of `keras-mp audit`: the model file, what was checked (how many
    samples, of how many given), the verdict."""
    over = sum(1 for la in report.layers if la.overflow_risk)
    low = sum(1 for la in report.layers if la.runs_low)
    if forward_only:
        n = "" if samples is None else f" ({samples} samples)"
        checked = f"random inputs{n}, forward checks only"
    else:
        checked = "one batch" if samples is None else f"one batch of {samples} samples"
        if samples is not None and given is not None and given > samples:
            checked += f" (the first {samples} of {given} given: --max-samples)"
    return (
        f"verdict: {os.path.basename(path)} ({len(report.layers)} layers, {checked}; "
        f"{over} overflowing float16, {low} running low): {report.verdict}"
    )


@contextlib.contextmanager
def _steps(con, total: int, enabled: bool) -> Iterator:
    """Yields `step(description)`: one rich bar; each call after the first advances it."""
    if not enabled:
        yield lambda description: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(bar_width=20),
        TextColumn("step {task.completed}/{task.total}"),  # steps, not layers
        TimeElapsedColumn(),
        console=con,
        transient=False,
    )
    task = bars.add_task("", total=total)
    phases = []

    def step(description: str):
        if phases:
            bars.advance(task)
        phases.append(description)
        bars.update(task, description=description)

    with bars:
        yield step
        bars.update(task, completed=total)


def run(args) -> int:
    """Runs `keras-mp audit` from parsed arguments; returns the exit status."""
    from keras_mp.cli.report import console

    for module in ("layers", "losses", "observe.callbacks"):  # register their objects for loading
        __import__(f"keras_mp.{module}")
    try:
        from keras_mp.observe.auditor import audit
    except ImportError as e:  # pragma: no cover
        raise ValueError(f"kmp.audit is not available in this installation ({e}).") from None
    con = console()
    limit = getattr(args, "max_samples", None)
    with _steps(con, total=3, enabled=not args.no_progress) as step:
        step(f"loading {os.path.basename(args.model)}")
        model = _load(args.model)
        step("reading the batch")
        given = load_batch(args.data, model)
        data = _first(given, limit)
        step(f"probing {len(model.layers)} layers on {_samples(data)} samples")
        report = audit(model, data, loss_scale=args.loss_scale)
        step(f"done: {len(report.layers)} layers audited")
    if args.data is None:
        con.print("note: no --data given: random inputs, forward checks only.")
    con.print(str(report), markup=False, soft_wrap=True)
    con.print(
        verdict(
            report,
            args.model,
            forward_only=args.data is None,
            samples=_samples(data),
            given=_samples(given),
        ),
        markup=False,
        soft_wrap=True,
    )
    if args.fix:
        con.print(
            fix(model, data, args.policy, args.margin, args.fix), markup=False, soft_wrap=True
        )
    return 0


def fix(model, data, policy: str, margin: float, out: str) -> str:
    """Converts `model` (its float32 form) under `policy`, calibrated on `data`; saves to `out`.

    Returns:
        The plan and where it was written, as text.
    """
    import keras_mp as kmp

    fp32 = model
    if any(x.compute_dtype != "float32" for x in model._flatten_layers(include_self=False)):
        fp32 = kmp.convert(model, "float32")  # calibration measures float32 values
    fixed = kmp.convert(fp32, policy, calibrate=data, margin=margin)
    kmp.saving.save_model(fixed, out)  # atomic: a killed run leaves no half-written file
    return f"{fixed.precision_plan}\nwrote {out}"
