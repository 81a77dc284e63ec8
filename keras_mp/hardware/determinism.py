"""The deterministic mode: `kmp.hardware.set_deterministic(seed)` and its report.

What "deterministic" means here: two runs of the same program, with the same data, on the
same machine and software, give bit-identical results. It does not mean identical across
machines: another CPU instruction set, another GPU generation, XLA on or off, oneDNN on or
off, or another library version change the rounding of every matmul. `kmp.fingerprint`'s
`diff` tells those rounding-level differences from real divergence.

What it costs is measured in `benchmarks/BENCHMARKS.md` section 11 (TensorFlow op
determinism on a CPU: within noise); on GPUs it was not measured.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import keras

__all__ = ["DeterminismReport", "XLA_DETERMINISM_FLAGS", "last_report", "set_deterministic"]

# Known to the XLA in TensorFlow 2.21 and jaxlib 0.10 (an unknown flag aborts XLA).
XLA_DETERMINISM_FLAGS = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
)

_LAST: DeterminismReport | None = None


@dataclasses.dataclass(frozen=True)
class DeterminismReport:
    """What `set_deterministic` set, and what it could not guarantee on this machine.

    Attributes:
        seed: the seed given.
        backend: the Keras backend.
        applied: what was switched on, one sentence each.
        caveats: what is not (or not verifiably) deterministic here, one sentence each.
        costs: what determinism costs, where it was measured.
        too_late: settings that came too late to take effect in this process.
    """

    seed: int
    backend: str
    applied: tuple = ()
    caveats: tuple = ()
    costs: tuple = ()
    too_late: tuple = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"Deterministic mode (seed {self.seed}, backend {self.backend})"]
        for title, items in (
            ("set", self.applied),
            ("TOO LATE in this process", self.too_late),
            ("not guaranteed", self.caveats),
            ("cost", self.costs),
        ):
            if items:
                lines.append(f"{title}:")
                lines += [f"  - {item}" for item in items]
        return "\n".join(lines)


def last_report() -> DeterminismReport | None:
    """The report of the last `set_deterministic` call in this process (None: never called)."""
    return _LAST


def _jax_started() -> bool | None:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # private API: unknown
        return None


def _tf_started() -> bool:
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context

        return bool(context.context()._initialized)
    except Exception:
        return True


def _add_xla_flags(flags) -> list:
    current = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in current}
    added = [f for f in flags if f.split("=")[0] not in names]
    if added:
        os.environ["XLA_FLAGS"] = " ".join(current + added)
    return added


def _gpus(backend: str) -> list:
    try:
        if backend == "tensorflow":
            import tensorflow as tf

            return [d.name for d in tf.config.list_physical_devices("GPU")]
        if backend == "jax":
            import jax

            return [str(d) for d in jax.devices() if d.platform == "gpu"]
        if backend == "torch":
            import torch

            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except Exception:
        return []
    return []


def _onednn_caveat() -> str:
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    state = {"0": "off", "1": "on"}.get(setting or "", "on (TensorFlow's default on x86)")
    return (
        f"oneDNN kernels are {state}: TensorFlow CPU results repeat with the same setting, "
        "thread count and CPU instruction set, but TF_ENABLE_ONEDNN_OPTS=0 vs 1 (or another "
        "CPU) changes them at rounding level; the variable is read when TensorFlow is "
        "imported"
    )


def set_deterministic(seed: int, *, xla_flags: bool = True) -> DeterminismReport:
    """Makes training repeat bit for bit on this machine, and says what it could not fix.

    It seeds Python, NumPy, Keras and the backend (`keras.utils.set_random_seed`), turns
    on TensorFlow's op determinism (`tf.config.experimental.enable_op_determinism`: ops
    without a deterministic kernel then raise instead of varying), on PyTorch
    `torch.use_deterministic_algorithms(True)`, and adds the XLA flags that make GPU
    reductions and scatters deterministic (`XLA_DETERMINISM_FLAGS`) to `XLA_FLAGS`.

    XLA reads `XLA_FLAGS` once, when it starts: JAX at its first computation, TensorFlow
    at its first XLA compilation. Call this first thing in the program (before building a
    model), or export the flags in the shell; the report lists what came too late. An
    unknown flag in `XLA_FLAGS` aborts XLA, so only flags known to TensorFlow 2.21 and
    jaxlib 0.10 are added.

    Not covered (listed in the report as it applies): results across machines, CPU
    instruction sets, GPU generations, thread counts, library versions, XLA on/off and
    oneDNN on/off; nondeterministic input pipelines (parallel `tf.data` maps with
    `deterministic=False`, shuffling without a seed); Python's hash randomisation of this
    process (fixed at start-up; `PYTHONHASHSEED` is set for child processes).

    Args:
        seed: a non-negative integer.
        xla_flags: add the XLA GPU determinism flags to `XLA_FLAGS` (default True).

    Returns:
        A `DeterminismReport` (print it, or `to_dict()`).

    Example:

    >>> report = kmp.hardware.set_deterministic(1234)  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    """
    global _LAST
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"set_deterministic: `seed` must be a non-negative integer, got {seed!r}.")
    backend = keras.backend.backend()
    applied, caveats, costs, too_late = [], [], [], []

    if xla_flags:
        jax_started, tf_started = _jax_started(), _tf_started()
        added = _add_xla_flags(XLA_DETERMINISM_FLAGS)
        applied.append(
            "XLA_FLAGS += "
            + " ".join(XLA_DETERMINISM_FLAGS)
            + ("" if added else " (already there)")
        )
        if jax_started and added:
            too_late.append(
                "JAX had already started, so its XLA will not read the new XLA_FLAGS: call "
                "set_deterministic before the first JAX computation (before building a "
                "model), or export XLA_FLAGS in the shell"
            )
        elif jax_started is None and "jax" in sys.modules:
            caveats.append("could not tell whether JAX had started (XLA_FLAGS may be too late)")
        if backend == "tensorflow" and tf_started and added:
            too_late.append(
                "TensorFlow had already started: XLA_FLAGS only takes effect if nothing was "
                "compiled with XLA yet in this process (set it before importing TensorFlow to "
                "be sure)"
            )
    os.environ["PYTHONHASHSEED"] = str(seed)
    keras.utils.set_random_seed(seed)
    applied.append(
        "keras.utils.set_random_seed: Python, NumPy, Keras' seed generator and TensorFlow's "
        "global seed" + (", torch.manual_seed" if backend == "torch" else "")
    )
    applied.append("PYTHONHASHSEED for child processes (this process' hashing is fixed)")

    if "tensorflow" in sys.modules or backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
        applied.append(
            "tf.config.experimental.enable_op_determinism(): TensorFlow ops without a "
            "deterministic kernel raise instead of varying (tf.data runs deterministically)"
        )
        if backend == "tensorflow":
            caveats.append(_onednn_caveat())
            costs.append(
                "TensorFlow op determinism on a 2-core x86-64 CPU: no measurable cost for a "
                "small CNN (median step on/off 1.02 in float32, 0.91 in mixed_bfloat16, within "
                "noise; benchmarks/BENCHMARKS.md section 11); on GPUs deterministic cuDNN "
                "algorithms and reductions can cost more (not measured)"
            )
    if backend == "torch":
        import torch

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        applied.append(
            "torch.use_deterministic_algorithms(True), cudnn.benchmark=False, "
            "CUBLAS_WORKSPACE_CONFIG=:4096:8 (read when CUDA starts)"
        )
    if backend == "jax":
        caveats.append(
            "JAX on CPU runs the same compiled XLA program the same way every time on one "
            "machine; results still change with the CPU model, the thread count and jaxlib "
            "version"
        )

    gpus = _gpus(backend)
    if not gpus:
        caveats.append(
            "no GPU here: the XLA and cuDNN GPU determinism settings are set but unverified "
            "on this machine"
        )
    else:
        caveats.append(
            f"GPU results ({', '.join(gpus)}) repeat only on the same GPU model, driver and "
            "library versions; another generation rounds differently"
        )
    caveats.append(
        "XLA on vs off (jit_compile), and different batch sizes or replica counts, reorder "
        "the arithmetic: runs agree only up to rounding (kmp.fingerprint.diff tells how far)"
    )
    _LAST = DeterminismReport(
        seed=seed,
        backend=backend,
        applied=tuple(applied),
        caveats=tuple(caveats),
        costs=tuple(costs),
        too_late=tuple(too_late),
    )
    return _LAST
