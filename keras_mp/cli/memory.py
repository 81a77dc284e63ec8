"""`keras-mp memory MODEL --batch-size N`: a model's train-step memory under each policy.

Prints `kmp.estimate_memory`'s table: the compiled train step's peak memory under each
policy (weights + optimizer state, temporaries), and whether it fits the device's memory (or
`--memory-gib`), for a saved `.keras` model or a bundled one: the `bench` workloads
(gpt, resnet50, cpu_gpt, cpu_resnet, tiny_gpt, tiny_resnet) and `compare`'s models
(cnn, mlp, transformer, t5). Runs under JAX (a fresh JAX process if Keras runs another
backend; without JAX installed it says to `pip install "keras_mp[jax]"`); nothing is
trained and no weight is materialised where the config rebuilds the model. Exit status:
0 every policy fits, 1 one does not (or does not compile), 2 bad input or no JAX, 3 a
model file that cannot be read (not a .keras archive, truncated, damaged).
`keras-mp fit` is the same command under its former name.

    keras-mp memory gpt --device benchmarks/h200.txtpb
    keras-mp memory model.keras --batch-size 8 --sequence-length 1024 --memory-gib 24
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from keras_mp.cli.errors import UnreadableModelError
from keras_mp.keras_glue.archive import read_config
from keras_mp.keras_glue.extras import install_command, installed

__all__ = ["DESCRIPTION", "HELP", "MODELS", "add_arguments", "check", "run"]

HELP = "the train step's memory under each policy (compiled, not run): will it fit?"
DESCRIPTION = (
    "Compile (do not run) one train step of MODEL (a .keras file, or a bundled name: "
    "gpt, resnet50, cpu_gpt, cpu_resnet, tiny_gpt, tiny_resnet, cnn, mlp, transformer, t5) "
    "on a batch of --batch-size under each policy, and print its peak memory (weights + "
    "optimizer state, temporaries) and whether it fits the device: exact for a GPU (XLA:GPU's "
    "buffer assignment; --device FILE.txtpb compiles for a GPU description without the GPU), "
    'an estimate on a CPU. Needs JAX (pip install "keras_mp[jax]"). Exit status 0: every '
    "policy fits; 1: one does not; 2: bad input or no JAX; 3: an unreadable model file."
)
WORKLOAD_MODELS = ("gpt", "resnet50", "cpu_gpt", "cpu_resnet", "tiny_gpt", "tiny_resnet")
COMPARE_MODELS = ("cnn", "mlp", "transformer", "t5")
MODELS = WORKLOAD_MODELS + COMPARE_MODELS
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", "lean_bfloat16")
RECOMPUTE = ("blocks", "matmuls", "elementwise")  # keras_mp.memory.memory_estimate's


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds `memory`'s arguments to its parser."""
    p.add_argument("model", metavar="MODEL", help="a .keras file or a bundled model name")
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="the batch (default: a bench workload's own; compare's models: 32; needed for "
        "a .keras file)",
    )
    p.add_argument(
        "--sequence-length",
        type=_positive_int,
        default=None,
        help="fills the inputs' unknown dimensions after the batch (e.g. a token sequence)",
    )
    p.add_argument(
        "--input-shapes",
        default=None,
        help="each input's shape after the batch, e.g. '1024' or '224,224,3;16' (overrides "
        "the model's input specs)",
    )
    p.add_argument(
        "--policies",
        default="float32,mixed_bfloat16,lean_bfloat16",
        help=f"comma-separated, from {','.join(POLICIES)} (default: %(default)s)",
    )
    p.add_argument("--optimizer", default="adamw", help="a Keras optimizer name (default: adamw)")
    p.add_argument(
        "--device",
        default=None,
        metavar="FILE.txtpb",
        help="compile for this XLA:GPU device description (e.g. benchmarks/h200.txtpb; needs "
        "the jax[cuda12] plugin, no GPU) instead of the local device",
    )
    p.add_argument("--memory-gib", type=_gib, default=None, help="fit in this much memory")
    p.add_argument(
        "--headroom-gib",
        type=_gib,
        default=None,
        help="kept free for workspaces (default: 1 on a GPU, 0 on a CPU)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default=None,
        help="compile the step with recomputation: blocks (kmp.recompute_blocks), matmuls "
        "(the same, matmul outputs kept), elementwise (kmp.recompute_elementwise)",
    )
    p.add_argument(
        "--fused-loss",
        action="store_true",
        help="compile the step with kmp.use_fused_loss (the loss without the whole logits)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")


def _shapes(text: str) -> list:
    shapes = []
    for part in text.split(";"):
        try:
            shape = tuple(int(d) for d in part.split(",") if d.strip())
        except ValueError:
            raise ValueError(
                f"--input-shapes: {text!r} is not like '1024' or '224,224,3;16'"
            ) from None
        if any(d <= 0 for d in shape):
            raise ValueError(f"--input-shapes: dimensions must be positive, got {text!r}")
        shapes.append(shape)
    return shapes


def check(args: argparse.Namespace) -> None:
    """Fails early, in one line, on bad names, paths and shapes; runs the command on JAX."""
    if args.model not in MODELS:
        if not args.model.endswith(".keras"):
            raise ValueError(
                f"MODEL: {args.model!r} is neither a .keras file nor a bundled model "
                f"({', '.join(MODELS)})"
            )
        if not os.path.exists(args.model):
            raise FileNotFoundError(f"no such model file: {args.model!r}")
        if args.batch_size is None:
            raise ValueError("--batch-size is needed for a .keras model")
        try:
            read_config(args.model)
        except ValueError as e:
            raise UnreadableModelError(str(e)) from e
    bad = [p for p in args.policies.split(",") if p.strip() not in POLICIES]
    if bad or not args.policies.strip():
        raise ValueError(f"--policies: unknown {bad}; choose from {', '.join(POLICIES)}")
    if args.input_shapes is not None:
        _shapes(args.input_shapes)
    if args.device is not None and not os.path.isfile(args.device):
        raise FileNotFoundError(f"--device: no such device description: {args.device!r}")
    if getattr(args, "backend", None) not in (None, "jax"):
        raise ValueError(
            f"--backend {args.backend}: the train step's memory is compiled by JAX whatever "
            "backend the model was trained under; leave --backend out"
        )
    if not installed("jax"):
        raise ValueError(
            "the train step's memory is read from JAX's compiler (XLA), and jax is not "
            f"installed: {install_command('jax')} (on an NVIDIA GPU: pip install "
            '"jax[cuda12]"); no --backend is needed, the step is compiled in a JAX process'
        )
    if args.device is not None:  # compile only: the host runs Keras on its CPU
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args.backend = "jax"  # XLA's compile-only memory analysis: JAX only


def _saved_model(path: str):
    """The model of a .keras file, from its config only (no weight is read or made), and
    its compiled loss (None if it was not compiled): `(model, loss)`.

    The compile config is read apart: compiling inside `unmaterialised()` would build the
    optimizer's variables where no variable may be made.
    """
    import keras

    from keras_mp.jax.memory import unmaterialised

    config = read_config(path)
    compiled = config.pop("compile_config", None)
    with unmaterialised():
        model = keras.saving.deserialize_keras_object(config)
    loss = (compiled or {}).get("loss")
    if loss is not None:
        loss = keras.saving.deserialize_keras_object(loss)
        loss = keras.losses.get(loss) if isinstance(loss, str) else loss
    return model, loss


def _bundled(name: str, batch: int | None):
    """A bundled model, unmaterialised, and its batch: `(model, x, y)`."""
    import keras
    import numpy as np

    from keras_mp.jax.memory import unmaterialised

    if name in WORKLOAD_MODELS:
        from keras_mp.cli.workloads import WORKLOADS

        workload = WORKLOADS[name]
        with unmaterialised():
            model = workload.build(keras)
        x, y = workload.data(np.random.default_rng(0))
        n = batch or len(x)
        return model, np.zeros((n, *x.shape[1:]), x.dtype), np.zeros((n, *y.shape[1:]), y.dtype)
    from keras_mp.cli.data import build_model, load_dataset
    from keras_mp.cli.settings import CompareConfig

    data = load_dataset(name, limit=256)
    with unmaterialised():
        model = build_model(name, data)
    n = batch or CompareConfig().batch_size
    x = np.zeros((n, *data.x_train.shape[1:]), data.x_train.dtype)
    return model, x, np.zeros((n,), "int32")


def _inputs(model, args) -> list:
    import numpy as np

    given = _shapes(args.input_shapes) if args.input_shapes else None
    specs = list(model.inputs or [])
    if given is not None:
        dtypes = [s.dtype for s in specs] if len(specs) == len(given) else ["float32"] * len(given)
        return [np.zeros((args.batch_size, *s), d) for s, d in zip(given, dtypes)]
    if not specs:
        raise ValueError(f"{args.model}: the model has no input specs; give --input-shapes")
    out = []
    for spec in specs:
        shape = list(spec.shape[1:])
        if any(d is None for d in shape):
            if args.sequence_length is None:
                raise ValueError(
                    f"{args.model}: input {spec.name!r} has shape {tuple(spec.shape)}; give "
                    "--sequence-length (or --input-shapes) for its unknown dimensions"
                )
            shape = [args.sequence_length if d is None else d for d in shape]
        out.append(np.zeros((args.batch_size, *shape), spec.dtype))
    return out


def run(args: argparse.Namespace) -> int:
    """Prints the report; returns 0 when every policy fits, else 1."""
    from keras_mp.memory.memory_estimate import estimate_memory

    y = loss = None
    if args.model in MODELS:
        model, x, y = _bundled(args.model, args.batch_size)
    else:
        model, loss = _saved_model(args.model)
        x = _inputs(model, args)
        x = x[0] if len(x) == 1 else x
    report = estimate_memory(
        model,
        x,
        y,
        policies=tuple(p.strip() for p in args.policies.split(",")),
        optimizer=args.optimizer,
        loss=loss,
        device=args.device,
        memory_gib=args.memory_gib,
        headroom_gib=args.headroom_gib,
        recompute=args.recompute,
        fused_loss=args.fused_loss,
    )
    if args.model in MODELS:
        report = dataclasses.replace(report, model=args.model)
    print(json.dumps(report.to_dict()) if args.json else report)
    return 0 if all(r.fits for r in report.rows) else 1
