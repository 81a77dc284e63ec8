"""Run fingerprints: a small JSON record of a training run, and a diff that classifies.

`Fingerprint` (a callback) and `Recorder` (for custom loops) record, every
`every_n_steps` steps and at step 0 (the initial weights): the loss of every step, the
loss scale, which steps were skipped for non-finite gradients, a hash of the optimizer
state, and for every model variable (in model order) a hash of its exact bytes, its
mean, RMS and max |x|, and an 8-number sketch (a count sketch with fixed pseudo-random
buckets and signs: the distance between two sketches estimates the L2 distance between
the two variables, unbiased, however the difference is spread). `diff(a, b)` answers
`"identical"`, `"rounding"` or `"diverged"` (at which step, first in which variable, and
the likely cause).

The rounding bound (derivation and measurements: `docs/reproducibility.md`). Two runs
that differ only in how the arithmetic is ordered or fused (XLA on/off, oneDNN on/off,
another GPU) perturb each gradient by about a unit roundoff `u_c` of the compute format
(2**-11 float16, 2**-8 bfloat16, 2**-24 float32). Adaptive optimizers (Adam & co.)
normalise every element of the update, which is discontinuous where a gradient crosses
0: a fraction ~u_c of the elements flip sign and move by a whole step the other way, so
an update differs by ~sqrt(u_c) of itself, not u_c. Independent from step to step,
these perturbations add like a random walk. With `U_i` the larger of the two runs'
motion of the weights between records `i-1` and `i` (L2 norm, from the sketches), `u_w`
the unit roundoff of the weights' dtype, `||w||` their norm and `k` the step, the runs
agree up to rounding at step `k` when their distance (all variables as one vector) is

    distance(k) <= C * sqrt(u_c * sum_{i <= k} U_i**2  +  u_w**2 * k * ||w||**2)

with `C = 8` (`ROUNDING_FACTOR`). For records every step and steady steps of size `U`,
that is `C * sqrt(u_c) * U * sqrt(k)`. Measured on this project's runs (TensorFlow
XLA on/off in float16, oneDNN on/off in bfloat16, JAX jit on/off): at most 0.35x the
bound over 12-40 steps. A different learning rate: 2.8x at step 1, growing. The
difference that a different batch makes to the weights (~0.35x) is within what rounding
can do, so the loss of every step is compared too: a batch changes it by about the
loss' step-to-step spread, rounding by much less (tolerance: 0.1x the median spread,
`LOSS_FACTOR`, or a unit roundoff of the loss). Skipped steps and the loss scale must
agree exactly. Rounding differences grow through the training dynamics: over long runs
they cross the bound, and `diff` then says "diverged" with the cause "no discrete event:
grew apart gradually".
"""

from __future__ import annotations

import json
import os
from typing import Any

import keras
import numpy as np

from keras_mp.fingerprint.diff import (
    FORMAT,
    LOSS_FACTOR,
    ROUNDING_FACTOR,
    VERSION,
    DiffReport,
    FingerprintError,
    diff,
    load,
)
from keras_mp.fingerprint.state import (
    Source,
    hash_all,
    loss_entry,
    replica_drift,
    run_meta,
    summarize,
)

__all__ = [
    "DiffReport",
    "Fingerprint",
    "FingerprintError",
    "LOSS_FACTOR",
    "ROUNDING_FACTOR",
    "Recorder",
    "diff",
    "load",
    "summarize",
]


def _as_state(state):
    """`(trainable, non_trainable, optimizer)` values -> the dict the JAX trainer keeps."""
    if state is None or isinstance(state, dict):
        return state
    keys = ("trainable_variables", "non_trainable_variables", "optimizer_variables")
    return dict(zip(keys, state))


def _loss_scale_optimizer(opt):
    return opt if isinstance(opt, keras.optimizers.LossScaleOptimizer) else None


class Recorder:
    """Records a run's fingerprint from a custom training loop (the engine of `Fingerprint`).

    Create it before the first training step, once the model is built: it records step 0
    (the weights before training) at once. Then call `step(loss)` after every training
    step; every `every_n_steps` steps it takes a record. Skipped
    steps are found from the optimizer's `iterations` (a `LossScaleOptimizer` leaves it
    unchanged on a skipped step): each step keeps an on-device copy of that counter, read
    on the host only when a record is taken, so steps without a record add no host sync.

    Args:
        model: the `keras.Model` being trained.
        optimizer: its optimizer (default `model.optimizer`); a `LossScaleOptimizer`
            adds the scale and the skipped steps, any other records neither.
        every_n_steps: steps between records.
        sketch_size: numbers per variable in the distance sketch.

    Example:

    >>> rec = kmp.fingerprint.Recorder(model, optimizer=opt, every_n_steps=10)  # doctest: +SKIP
    >>> for x, y in batches:  # doctest: +SKIP
    ...     loss = train_step(x, y)
    ...     rec.step(loss)
    >>> rec.save("run.json")  # doctest: +SKIP
    """

    def __init__(self, model, optimizer=None, every_n_steps: int = 100, sketch_size: int = 8):
        from keras_mp.observe.telemetry import positive_int

        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.every_n_steps = positive_int("Recorder", "every_n_steps", every_n_steps)
        self.sketch_size = positive_int("Recorder", "sketch_size", sketch_size)
        self.steps = 0
        self.records: list = []
        self.meta: dict | None = None
        self._source = Source(model, self.optimizer)
        self._lso = _loss_scale_optimizer(self.optimizer)
        self._pending: list = []  # (step, loss, device copy of iterations) since the last record
        self._applied: int | None = None
        self._skipped = 0
        self.begin()

    # -- recording -------------------------------------------------------------------

    def begin(self, state=None) -> None:
        """Records step 0 (the weights before training) if nothing is recorded yet."""
        if self.meta is None:
            if not self._source.variables:
                raise ValueError(
                    "Recorder: the model has no variables yet; build it first (call it on a "
                    "batch, or `model.build(input_shape)`), before the first training step."
                )
            self.meta = run_meta(self.model, self.optimizer, self.every_n_steps, self.sketch_size)
            self.variables = [
                {"path": v.path, "dtype": str(v.dtype), "shape": list(v.shape)}
                for v in self._source.variables
            ]
        if not self.records:
            if self._lso is not None:
                self._applied = int(np.asarray(self._iterations(state)))
            self._take(state)

    def _iterations(self, state=None):
        return self._source.value(self.optimizer.iterations, state)

    def step(self, loss=None, *, state=None, steps: int = 1) -> dict | None:
        """Counts training step(s) that just ran; takes a record when one is due.

        Args:
            loss: the step's loss (a number or scalar tensor), or None.
            state: on JAX with a stateless loop, `(trainable_values,
                non_trainable_values, optimizer_values)` after the step, in the order of
                `model.trainable_variables`, `model.non_trainable_variables` and
                `optimizer.variables`; default: the variables' values.
            steps: how many steps ran (`steps_per_execution`); the loss is their mean.

        Returns:
            The record taken at this step, or None.
        """
        state = _as_state(state)
        if self.meta is None or not self.records:
            self.begin(state)
        first = self.steps + 1
        self.steps += steps
        snap = keras.ops.copy(self._iterations(state)) if self._lso is not None else None
        self._pending.append((first, self.steps, loss, snap))
        if self.steps // self.every_n_steps > (first - 1) // self.every_n_steps:
            return self._take(state)
        return None

    def record(self, state=None) -> dict:
        """Takes a record now (if the current step has none yet) and returns it."""
        state = _as_state(state)
        if self.meta is None or not self.records:
            self.begin(state)
        if self.records[-1]["step"] == self.steps:
            return self.records[-1]
        return self._take(state)

    def _take(self, state=None) -> dict:
        losses, skipped_steps = [], []
        for first, last, loss, snap in self._pending:
            value = None if loss is None else float(np.asarray(keras.ops.convert_to_numpy(loss)))
            losses += [None] * (last - first) + [loss_entry(value)]
            if snap is not None:
                applied = int(np.asarray(snap))
                missing = (last - first + 1) - (applied - self._applied)
                skipped_steps += list(range(last - missing + 1, last + 1)) if missing > 0 else []
                self._applied = applied
        self._pending = []
        self._skipped += len(skipped_steps)
        scale = None
        if self._lso is not None:
            scale = (
                float(np.asarray(self._source.value(self._lso.dynamic_scale, state)))
                if self._lso.built
                else float(self._lso.initial_scale)
            )
        record = {
            "step": self.steps,
            "loss": losses[-1] if losses else None,
            "losses": losses,
            "scale": scale,
            "skipped": self._skipped if self._lso is not None else None,
            "skipped_steps": skipped_steps,
            "optimizer_hash": hash_all(self._source.optimizer_values(state)),
            "vars": [summarize(v, self.sketch_size) for v in self._source.model_values(state)],
        }
        drift = replica_drift(self.model, self._source.variables)
        if drift:
            record["replica_drift"] = drift
        self.records.append(record)
        return record

    # -- output ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The fingerprint as a JSON-able dict (`format`, `version`, `meta`, `variables`,
        `records`)."""
        if self.meta is None:
            self.begin()
        return {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "variables": self.variables,
            "records": self.records,
        }

    def save(self, path) -> str:
        """Writes the fingerprint as JSON (one record per line) and returns the path."""
        path = os.fspath(path)
        data = self.to_dict()

        def lines(items):
            return ",\n".join("  " + json.dumps(x, separators=(",", ":")) for x in items)

        text = (
            f'{{\n "format": {json.dumps(data["format"])},\n "version": {data["version"]},\n'
            f' "meta": {json.dumps(data["meta"], sort_keys=True)},\n'
            f' "variables": [\n{lines(data["variables"])}\n ],\n'
            f' "records": [\n{lines(data["records"])}\n ]\n}}\n'
        )
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path


@keras.saving.register_keras_serializable(package="keras_mp")
class Fingerprint(keras.callbacks.Callback):
    """Writes a fingerprint of a `fit` run to a small JSON file (`kmp.fingerprint.diff`).

    Records step 0 at the start of training, then every `every_n_steps` steps and at the
    end of training; the file is written at every epoch end and at the end of training.
    The loss of each step is derived from the running mean Keras logs (exact when the
    epoch's batches have equal sizes; after a non-finite loss it is unknown until the
    epoch ends). On JAX the weights are read from the training state, only at record
    steps. Size: ~250 bytes per variable per record (a 1M-parameter, 30-variable model
    recorded 100 times: under 1 MB).

    Args:
        path: the JSON file to write.
        every_n_steps: steps between records.
        sketch_size: numbers per variable in the distance sketch.

    Example:

    >>> fp = kmp.fingerprint.Fingerprint("run_a.json", every_n_steps=10)
    >>> model.fit(x, y, callbacks=[fp])  # doctest: +SKIP
    >>> print(kmp.fingerprint.diff("run_a.json", "run_b.json"))  # doctest: +SKIP
    """

    def __init__(self, path, every_n_steps: int = 100, sketch_size: int = 8):
        super().__init__()
        self.path = os.fspath(path)
        self.every_n_steps = every_n_steps
        self.sketch_size = sketch_size
        self.recorder: Recorder | None = None

    def on_train_begin(self, logs=None):
        if self.recorder is None:
            self.recorder = Recorder(self._model, None, self.every_n_steps, self.sketch_size)
        self.recorder.begin()

    def on_epoch_begin(self, epoch, logs=None):
        self._seen, self._mean = 0, 0.0

    def on_train_batch_end(self, batch, logs=None):
        seen = batch + 1
        n = max(seen - self._seen, 1)
        loss = None
        mean = (logs or {}).get("loss")
        if mean is not None and np.isfinite(mean) and np.isfinite(self._mean):
            loss = (seen * float(mean) - self._seen * self._mean) / n
        self._seen, self._mean = seen, (float(mean) if mean is not None else np.nan)
        self.recorder.step(loss, steps=n)

    def on_epoch_end(self, epoch, logs=None):
        self.recorder.save(self.path)

    def on_train_end(self, logs=None):
        self.recorder.record()
        self.recorder.save(self.path)

    def to_dict(self) -> dict:
        return self.recorder.to_dict() if self.recorder is not None else {}

    def get_config(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "every_n_steps": self.every_n_steps,
            "sketch_size": self.sketch_size,
        }
