"""The peak memory of a model's train step under each policy, estimated before a run.

`estimate_memory(model, x)` compiles (does not run) one train step of `model` on a batch shaped
like `x` under each precision policy, with the optimizer and loss a run would use, and
reads XLA's buffer assignment: the step's peak bytes (weights + optimizer state,
gradients, activations and every other temporary), whether that fits the device's memory,
and whether the number is exact (XLA:GPU, the buffers the GPU runs) or an estimate
(XLA:CPU fuses less; the runtime adds workspaces on a GPU). No weight is materialised where
the model's config can rebuild it (`keras_mp.jax.memory.abstract_copy`): a model too large
for this machine's memory can be sized here, for a GPU it does not have (a device
description, e.g. `benchmarks/h200.txtpb`, with JAX's CUDA plugin installed).

JAX only computes it. On TensorFlow the model is saved to a temporary `.keras` file and
sized by `keras-mp memory` in a `KERAS_BACKEND=jax` subprocess: JAX must be installed
(`pip install "keras_mp[jax]"`); without it the call raises an `ImportError` saying so.

The names `will_it_fit`, `FitReport` and `PolicyFit` (`keras_mp.memory.fit`) are aliases kept for
code written before this module had its name.

Example:

```python
report = kmp.estimate_memory(model, x_batch)                  # the local device
print(report)                                             # one row per policy
report["lean_bfloat16"].peak_bytes / 2**30
kmp.estimate_memory(model, x_batch, device="benchmarks/h200.txtpb", memory_gib=24)
```
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import keras

from keras_mp.keras_glue.extras import require

__all__ = [
    "DEFAULT_POLICIES",
    "MemoryReport",
    "POLICIES",
    "PolicyMemory",
    "RECOMPUTE",
    "estimate_memory",
]

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "lean_bfloat16")
# `recompute=`: kmp.recompute_blocks (save="inputs"), the same with save="matmuls",
# kmp.recompute_elementwise
RECOMPUTE = ("blocks", "matmuls", "elementwise")
DEFAULT_POLICIES = ("float32", "mixed_bfloat16", "lean_bfloat16")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PolicyMemory:
    """One policy's compiled train step.

    Attributes:
        policy: the policy's name.
        peak_bytes: the step's peak: arguments + temporaries + outputs not aliased.
        weights_bytes: the model's variables.
        optimizer_bytes: the optimizer's state (moments, compensation, scales, counters).
        temp_bytes: everything else the step allocates: gradients, activations, workspace.
        fits: whether `peak_bytes` plus the report's headroom fits its memory.
        error: why the step could not be compiled (then the byte counts are 0).
    """

    policy: str
    peak_bytes: int
    weights_bytes: int
    optimizer_bytes: int
    temp_bytes: int
    fits: bool
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """`estimate_memory`'s answer: one `PolicyMemory` per policy, and what it was measured on.

    Attributes:
        model: the model's name.
        batch: the shape(s) of the batch's inputs.
        device: the device compiled for, in words.
        memory_bytes: the memory a step may use on it (or the `memory_gib` asked about).
        headroom_bytes: kept free for what the step's buffers do not count (workspaces).
        exact: True for XLA:GPU's buffer assignment, False for an XLA:CPU estimate.
        rows: the `PolicyMemory`s, in the order asked.
        recompute: the recomputation each step was compiled with (`RECOMPUTE`), or None.
        fused_loss: whether each step took its loss with `kmp.use_fused_loss`.
    """

    model: str
    batch: list
    device: str
    memory_bytes: int
    headroom_bytes: int
    exact: bool
    rows: list
    recompute: str | None = None
    fused_loss: bool = False

    def __getitem__(self, policy: str) -> PolicyMemory:
        for row in self.rows:
            if row.policy == policy:
                return row
        raise KeyError(f"no policy {policy!r} in this report; it has {self.policies}")

    @property
    def policies(self) -> list:
        """The policies measured, in order."""
        return [r.policy for r in self.rows]

    def to_dict(self) -> dict:
        """The report as plain data (JSON-serialisable)."""
        out = dataclasses.asdict(self)
        out["rows"] = [dataclasses.asdict(r) for r in self.rows]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> MemoryReport:
        """The report `to_dict` wrote."""
        rows = [PolicyMemory(**r) for r in data["rows"]]
        return cls(**{**data, "rows": rows})

    def __str__(self) -> str:
        kind = "exact: XLA:GPU's buffers" if self.exact else "an estimate: XLA:CPU's buffers"
        peaks = [r.peak_bytes for r in self.rows]
        unit, size = ("GiB", GIB) if max(peaks, default=0) >= GIB else ("MiB", 2**20)
        lines = [
            f"Train-step memory: {self.model}, batch {self.batch}, on {self.device}",
            f"memory {self.memory_bytes / GIB:.2f} GiB, {self.headroom_bytes / GIB:.2f} GiB "
            f"kept free; peaks {kind}",
            *self._levers(),
            "",
            f"{'policy':<16}{'peak ' + unit:>10}{'weights':>10}{'optimizer':>11}{'temps':>10}"
            "  fits",
        ]
        for r in self.rows:
            if r.error:
                lines.append(f"{r.policy:<16}{'-':>10}{'':>31}  error: {r.error}")
                continue
            lines.append(
                f"{r.policy:<16}{r.peak_bytes / size:>10.2f}{r.weights_bytes / size:>10.2f}"
                f"{r.optimizer_bytes / size:>11.2f}{r.temp_bytes / size:>10.2f}  "
                f"{'yes' if r.fits else 'NO'}"
            )
        return "\n".join(lines)

    def _levers(self) -> list:
        levers = [f"recompute={self.recompute!r}"] if self.recompute else []
        levers += ["fused_loss=True"] if self.fused_loss else []
        return [f"with {', '.join(levers)}"] if levers else []


def _check_policies(policies) -> tuple:
    if isinstance(policies, str):
        policies = (policies,)
    policies = tuple(policies)
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ValueError(
            f"estimate_memory: invalid `policies`={list(policies)!r}; each must be one of "
            f"{list(POLICIES)}."
        )
    return policies


def _optimizer(optimizer: Any, policy: str):
    """A fresh optimizer for `policy`: the given one's config, wrapped as a run wraps it."""
    from keras_mp.lean import LeanOptimizer
    from keras_mp.scaling.loss_scale import LossScaleOptimizer

    if isinstance(optimizer, str):
        inner = keras.optimizers.get(optimizer)
    elif isinstance(optimizer, keras.optimizers.Optimizer):
        inner = optimizer.__class__.from_config(optimizer.get_config())
    else:
        raise ValueError(
            f"estimate_memory: invalid `optimizer`={optimizer!r}: a Keras optimizer or its name."
        )
    if policy == "lean_bfloat16":
        return LeanOptimizer(inner)
    if policy == "mixed_float16":
        return LossScaleOptimizer(inner)
    return inner


def _loss(model, loss: Any):
    if loss is not None:
        return loss
    compiled = getattr(model, "loss", None)
    if compiled is not None:
        return compiled
    import keras_mp.numerics.losses as losses

    return losses.SparseCategoricalCrossentropy(from_logits=True)


def _spec(a):
    import numpy as np

    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        a = np.asarray(a)
    return keras.KerasTensor(tuple(a.shape), dtype=keras.backend.standardize_dtype(a.dtype))


def _targets(model, x, loss):
    """Labels shaped as `loss` takes them for `model`'s output on `x`: class ids for a sparse
    categorical loss, else the output's shape and dtype."""
    out = model.compute_output_spec(keras.tree.map_structure(_spec, x))
    sparse = "sparse" in type(loss).__name__.lower() or "sparse" in str(loss).lower()
    if sparse:
        return keras.KerasTensor(tuple(out.shape[:-1]), dtype="int32")
    return keras.KerasTensor(tuple(out.shape), dtype="float32")


def _policy_model(model, policy: str, abstract: bool):
    from keras_mp.conversion import convert
    from keras_mp.jax.memory import unmaterialised
    from keras_mp.keras_glue.quiet import ignoring

    with unmaterialised() if abstract else _nothing(), ignoring(UserWarning):
        return convert(model, policy, check=None)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _measure(
    model, x, y, policy, optimizer, loss, target, abstract: bool, recompute=None, fused=False
) -> dict:
    from keras_mp.jax.memory import step_memory, unmaterialised

    converted = _policy_model(model, policy, abstract)
    if recompute == "elementwise":  # on the converted model: convert makes a new one
        from keras_mp.memory.recompute import recompute_elementwise

        recompute_elementwise(converted)
    elif recompute is not None:
        from keras_mp.memory.blocks import recompute_blocks

        recompute_blocks(converted, save="inputs" if recompute == "blocks" else "matmuls")
    converted.compile(optimizer=_optimizer(optimizer, policy), loss=loss)
    if fused:
        from keras_mp.numerics.fused_lm_loss import use_fused_loss

        use_fused_loss(converted)
    with unmaterialised():
        converted.optimizer.build(converted.trainable_variables)
    return step_memory(converted, x, y, target)


def estimate_memory(
    model: keras.Model,
    x: Any,
    y: Any = None,
    *,
    policies=DEFAULT_POLICIES,
    optimizer: Any = "adamw",
    loss: Any = None,
    device: Any = None,
    memory_gib: float | None = None,
    headroom_gib: float | None = None,
    recompute: str | None = None,
    fused_loss: bool = False,
) -> MemoryReport:
    """The peak memory of `model`'s train step under each policy, compiled, not run.

    Each policy's step is what `kmp.convert(model, policy)` compiled with `optimizer` and
    `loss` runs (`"lean_bfloat16"`: `kmp.LeanOptimizer(optimizer)`; `"mixed_float16"`:
    `kmp.LossScaleOptimizer(optimizer)`): one `train_step` on a batch shaped like `x`,
    compiled by XLA for `device` with its state donated as `model.fit` donates it. Only shapes and
    dtypes are used; where the model's config rebuilds it, no weight is materialised.

    Args:
        model: a built Keras model (float32, as it would be converted).
        x: a batch of inputs (arrays, or anything with `shape` and `dtype`), nested as the
            model takes them; its first dimension is the batch size.
        y: the batch's targets; default: shaped from the model's output for `loss`
            (class ids for a sparse categorical loss).
        policies: names from `POLICIES`.
        optimizer: a Keras optimizer or its name (each policy gets a fresh copy).
        loss: the loss; default: the model's compiled loss, else
            `kmp.losses.SparseCategoricalCrossentropy(from_logits=True)`.
        device: None (the local device), a `jax.Device`, or the path of an XLA:GPU device
            description (`GpuTargetConfig` .txtpb, e.g. `benchmarks/h200.txtpb`), compiled
            for without the GPU (JAX's CUDA plugin needed).
        memory_gib: the memory to fit in (e.g. `24` for a 24 GB card); default: the device's.
        headroom_gib: kept free for what the step's buffers do not count (cuDNN/cuBLAS
            workspaces, the allocator's rounding); default 1 GiB on a GPU, 0 on a CPU.
        recompute: the step with recomputation (issue 54's lever 4), applied to each
            converted model: `"blocks"` (`kmp.recompute_blocks`: each repeated block, a
            keras_hub backbone's decoder blocks, recomputed from its inputs), `"matmuls"`
            (the same, matmul and attention outputs kept) or `"elementwise"`
            (`kmp.recompute_elementwise`); None (default): none.
        fused_loss: the step with `kmp.use_fused_loss` (lever 3: the loss from the hidden
            states, without the whole logits; keras_hub causal LMs and models ending in
            their vocabulary projection).

    Returns:
        A `MemoryReport`: `print` it, index it by policy, or `to_dict()`.

    Raises:
        ValueError: for a bad argument (named), or an unbuilt model.
        keras_mp.keras_glue.extras.MissingExtraError: (an `ImportError`) on another backend without
            JAX installed, naming the command that installs it (`pip install "keras_mp[jax]"`).
        RuntimeError: when the JAX subprocess fails, with its last error line.

    Example:

    ```python
    report = kmp.estimate_memory(model, np.zeros((8, 1024), "int32"))
    print(report)
    report["lean_bfloat16"].fits
    ```
    """
    policies = _check_policies(policies)
    if recompute is not None and recompute not in RECOMPUTE:
        raise ValueError(
            f"estimate_memory: invalid `recompute`={recompute!r}; one of {list(RECOMPUTE)} or None."
        )
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(f"estimate_memory: `model` must be a built keras.Model, got {model!r}.")
    for name, value in (("memory_gib", memory_gib), ("headroom_gib", headroom_gib)):
        if value is not None and (isinstance(value, bool) or not value >= 0):
            raise ValueError(f"estimate_memory: invalid `{name}`={value!r}: a number >= 0.")
    if keras.backend.backend() != "jax":
        return _in_jax_subprocess(
            model, x, policies, optimizer, loss, device, memory_gib, headroom_gib,
            recompute, fused_loss,
        )  # fmt: skip
    from keras_mp.jax.memory import abstract_copy, compile_device

    target = compile_device(device)
    loss = _loss(model, loss)
    twin = abstract_copy(model)
    abstract = twin is not None
    source = twin if abstract else model
    x = keras.tree.map_structure(_spec, x)
    y = _targets(source, x, loss) if y is None else keras.tree.map_structure(_spec, y)
    memory = int(memory_gib * GIB) if memory_gib is not None else target.memory_bytes
    if headroom_gib is None:
        headroom_gib = 1.0 if target.exact else 0.0
    headroom = int(headroom_gib * GIB)
    rows = []
    for policy in policies:
        try:
            m = _measure(
                source, x, y, policy, optimizer, loss, target, abstract, recompute, fused_loss
            )
        except Exception as error:  # a policy that does not compile is reported, not raised
            rows.append(PolicyMemory(policy, 0, 0, 0, 0, False, f"{type(error).__name__}: {error}"))
            continue
        state = m["weights_bytes"] + m["optimizer_bytes"]
        rows.append(
            PolicyMemory(
                policy=policy,
                peak_bytes=m["peak_bytes"],
                weights_bytes=m["weights_bytes"],
                optimizer_bytes=m["optimizer_bytes"],
                temp_bytes=max(0, m["peak_bytes"] - state),
                fits=m["peak_bytes"] + headroom <= memory,
            )
        )
    batch = [list(t.shape) for t in keras.tree.flatten(x)]
    return MemoryReport(
        model.name, batch, target.name, memory, headroom, target.exact, rows, recompute,
        bool(fused_loss),
    )  # fmt: skip


def _in_jax_subprocess(
    model, x, policies, optimizer, loss, device, memory_gib, headroom_gib, recompute, fused
):
    """TensorFlow (or torch): the model saved to a .keras file, sized by `keras-mp memory` under
    `KERAS_BACKEND=jax` in a subprocess."""
    if loss is not None or not isinstance(optimizer, str):
        raise ValueError(
            f"estimate_memory on the {keras.backend.backend()} backend sizes the step in a JAX "
            "subprocess from the saved model: give `optimizer` by name and leave `loss` "
            "None (the compiled loss is saved with the model), or run it under "
            "KERAS_BACKEND=jax."
        )
    shapes = [tuple(getattr(t, "shape", ())) for t in keras.tree.flatten(x)]
    if not shapes or not shapes[0]:
        raise ValueError("estimate_memory: `x` must be a batch (arrays with a batch dimension).")
    require("jax", f"estimate_memory on the {keras.backend.backend()} backend (XLA's compiler)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{model.name}.keras")
        model.save(path)
        cmd = [
            sys.executable, "-m", "keras_mp.cli", "memory", path, "--json",
            "--batch-size", str(shapes[0][0]), "--policies", ",".join(policies),
            "--optimizer", optimizer,
            "--input-shapes", ";".join(",".join(map(str, s[1:])) for s in shapes),
        ]  # fmt: skip
        if device is not None:
            cmd += ["--device", os.fspath(device)]
        if memory_gib is not None:
            cmd += ["--memory-gib", str(memory_gib)]
        if headroom_gib is not None:
            cmd += ["--headroom-gib", str(headroom_gib)]
        if recompute is not None:
            cmd += ["--recompute", recompute]
        if fused:
            cmd += ["--fused-loss"]
        env = dict(os.environ, KERAS_BACKEND="jax")
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return _subprocess_report(done)


def _subprocess_report(done: subprocess.CompletedProcess) -> MemoryReport:
    """The report `keras-mp memory --json` printed as its last line. Exit status 1 means
    "a policy does not fit" only with that line; a process that died prints none."""
    lines = done.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1]) if done.returncode in (0, 1) and lines else None
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or "rows" not in data:
        errors = done.stderr.strip().splitlines() or lines or ["no output"]
        raise RuntimeError(
            "estimate_memory: sizing the step in a JAX subprocess (KERAS_BACKEND=jax keras-mp "
            f"memory) failed with exit status {done.returncode}: {errors[-1]}"
        )
    return MemoryReport.from_dict(data)
