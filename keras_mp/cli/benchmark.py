"""Performance harness: train-step speed and memory of stock Keras vs keras_mp policies.

Each configuration (workload x policy x `jit_compile`) runs in its own subprocess and gives
one JSON line: model, policy, backend, device, compile time, median/min step time, tokens or
images per second, model TFLOP/s, peak memory, and speedups against the FP32 row and the stock
Keras row of the same policy measured in the same invocation. Policies:

- `float32`: FP32 (TF32 allowed for matmuls/convolutions on Ampere+ GPUs).
- `float32_strict`: FP32 with TF32 off.
- `stock_mixed_bfloat16`, `stock_mixed_float16`: Keras' global dtype policy, Keras' loss and
  (FP16) `keras.optimizers.LossScaleOptimizer`: what a user gets from Keras alone.
- `keras_mp_mixed_bfloat16`, `keras_mp_mixed_float16`: `kmp.convert(model, kmp.Policy(...))`
  (FP32 keep-list), `kmp.losses.SparseCategoricalCrossentropy(from_logits=True)` and, for
  FP16, `kmp.LossScaleOptimizer` (dynamic scaling).
- `keras_mp_float32`: the FP32 model with keras_mp's loss; it counts as an FP32
  configuration for `speedup_vs_best_fp32`.

A policy may carry `@jit` or `@nojit` to override `--jit/--no-jit` for that row, e.g.
`--policies float32@nojit,float32@jit,keras_mp_mixed_bfloat16@nojit`, or `@remat`: XLA with
its rematerialization pass given a memory limit (`keras_mp.cli.measure.REMAT_XLA_FLAG` in the
row's `XLA_FLAGS`; GPU only), which recomputes cheap element-wise tensors in the backward pass
instead of keeping them: less memory for a little more memory traffic.

Example:

```
python -m keras_mp.cli.benchmark --models cpu_gpt --steps 10 --out results.jsonl
KERAS_BACKEND=jax python -m keras_mp.cli.benchmark --models gpt,resnet50 --backend jax
```
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from keras_mp.cli.jsonl import emit
from keras_mp.cli.measure import POLICIES, _names, config_env, default_jit, run_one
from keras_mp.cli.startup import check_backend_installed, configured_backend, strip_backend_logs
from keras_mp.cli.workloads import WORKLOADS

__all__ = [
    "POLICIES",
    "WORKLOADS",
    "add_arguments",
    "add_speedups",
    "build_parser",
    "check",
    "default_jit",
    "main",
    "run_configurations",
    "run_one",
]


def _subprocess(args, model_name: str, policy: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "keras_mp.cli.benchmark",
        "--one",
        model_name,
        policy,
        *_passthrough(args),
    ]
    env = config_env(
        policy, dict(os.environ, KERAS_BACKEND=args.backend, **dict(_env_pairs(args.env)))
    )
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {args.timeout} s"}
    lines = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    stderr = strip_backend_logs(proc.stderr)  # at the level the subprocess logged at
    return {"error": f"exit status {proc.returncode}: {stderr[-1500:]}"}


def _passthrough(args) -> list:
    out = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.jit is not None:
        out.append("--jit" if args.jit else "--no-jit")
    if args.keep_fp32 is not None:
        out += ["--keep-fp32", ",".join(args.keep_fp32)]
    if args.intra_op or args.inter_op:
        out += ["--intra-op", str(args.intra_op), "--inter-op", str(args.inter_op)]
    if args.remat_layers:
        out += ["--remat-layers", ",".join(args.remat_layers)]
    if args.recompute:
        out.append("--recompute")
    return out


def _env_pairs(pairs) -> list:
    out = []
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--env expects KEY=VALUE. Received: {pair!r}")
        out.append((key, value))
    return out


def _speedup(ref, row) -> float | None:
    if not ref or "step_ms_median" not in ref or "step_ms_median" not in row:
        return None
    return round(ref["step_ms_median"] / row["step_ms_median"], 3)


def add_speedups(row: dict, earlier: list) -> dict:
    """Adds speedups (reference median step time / this one; > 1 is faster) to `row`.

    `speedup_vs_fp32`: the `float32` row of the same model and `jit_compile`;
    `speedup_vs_best_fp32`: the fastest FP32 row (`float32`, `keras_mp_float32`,
    `float32_strict`) of the model so far;
    `speedup_vs_stock`: the stock Keras row of the same dtype policy and `jit_compile`
    (keras_mp rows, `keras_mp_float32` against `float32`; stock mixed rows get 1.0), with
    `@remat` if there is one, else without: a `@remat` row is set against the plain stock
    step. Missing references give `None`.
    """
    same = [r for r in earlier + [row] if r["model"] == row["model"] and "error" not in r]
    same_jit = [r for r in same if r.get("jit_compile") == row.get("jit_compile")]
    same_jit.sort(key=lambda r: r.get("xla_remat", False) != row.get("xla_remat", False))
    fp32 = next((r for r in same_jit if r["policy"] == "float32"), None)
    fp32_rows = [r for r in same if POLICIES.get(r["policy"]) == "float32"]
    best = min(fp32_rows, key=lambda r: r["step_ms_median"], default=None)
    row["speedup_vs_fp32"] = _speedup(fp32, row)
    row["speedup_vs_best_fp32"] = _speedup(best, row)
    dtype = POLICIES.get(row["policy"], "float32")
    if dtype != "float32" or row["policy"] == "keras_mp_float32":
        stock_name = {
            "float32": "float32",
            "float8": "stock_mixed_bfloat16",
            "lean_bfloat16": "stock_mixed_bfloat16",
        }.get(dtype, "stock_" + dtype)
        stock = next((r for r in same_jit if r["policy"] == stock_name), None)
        row["speedup_vs_stock"] = _speedup(stock, row)
    return row


def _fmt(value) -> str:
    return "" if value is None else f"{value:.2f}"


def _table(rows: list) -> str:
    head = (
        "| model | policy | jit | step ms (median) | units/s | TFLOP/s | peak GiB | "
        "vs fp32 | vs best fp32 | vs stock |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['policy']} | | error | | | | | | |")
            continue
        jit = ("on" if r["jit_compile"] else "off") + (", remat" if r.get("xla_remat") else "")
        if r.get("remat_layers"):
            jit += f", RematScope({','.join(r['remat_layers'])})"
        if r.get("recompute_elementwise"):
            jit += ", recompute_elementwise"
        lines.append(
            f"| {r['model']} | {r['policy']} | {jit} | "
            f"{r['step_ms_median']:.1f} | {r['units_per_s']:.0f} | {r['tflops']:.3g} | "
            f"{r['peak_mem_gib']:.2f} ({'RSS' if r['peak_mem_kind'] == 'host_rss' else 'dev'}"
            + (f"; tensors {r['tensor_peak_mib'] / 1024:.2f}" if "tensor_peak_mib" in r else "")
            + ")"
            f" | {_fmt(r['speedup_vs_fp32'])} | {_fmt(r['speedup_vs_best_fp32'])} | "
            f"{_fmt(r.get('speedup_vs_stock'))} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the harness (`benchmarks/run.py`, `python -m` this module)."""
    p = argparse.ArgumentParser(
        prog="keras-mp bench",
        description="Time train steps of GPT / ResNet-50 workloads under stock Keras and "
        "keras_mp precision policies, one subprocess per configuration, one JSON line each.",
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the harness' options to `p` (`keras-mp bench` adds its own after them)."""
    p.add_argument(
        "--models",
        default="cpu_gpt,cpu_resnet",
        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: %(default)s)",
    )
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated, from: "
        + ", ".join(POLICIES)
        + "; append @jit or @nojit to force XLA on/off for one row, @remat for XLA with a "
        "memory limit (default: all)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps (default: %(default)s)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps after the compiling one (default: %(default)s)",
    )
    p.add_argument("--out", help="append the JSON lines to this file")
    p.add_argument(
        "--backend",
        default=os.environ.get("KERAS_BACKEND", "tensorflow"),
        choices=("tensorflow", "jax", "torch"),
        help="Keras backend of the subprocesses (default: $KERAS_BACKEND or tensorflow)",
    )
    p.add_argument(
        "--timeout", type=int, default=600, help="seconds per configuration (default: %(default)s)"
    )
    p.add_argument(
        "--jit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="jit_compile for every row (default: XLA except TensorFlow on CPU "
        "for float32/bfloat16, where oneDNN is faster)",
    )
    p.add_argument(
        "--keep-fp32",
        type=lambda s: tuple(e for e in s.split(",") if e),
        help="keep-list for keras_mp policies, comma-separated (default: kmp.DEFAULT_KEEP_FP32)",
    )
    p.add_argument(
        "--env",
        action="append",
        metavar="KEY=VALUE",
        help="environment variable for the subprocesses (repeatable), e.g. TF_ENABLE_ONEDNN_OPTS=0",
    )
    p.add_argument("--intra-op", type=int, default=0, help="TF intra-op threads (0: default)")
    p.add_argument("--inter-op", type=int, default=0, help="TF inter-op threads (0: default)")
    p.add_argument(
        "--remat-layers",
        type=lambda s: tuple(e for e in s.split(",") if e),
        default=(),
        help="layer-name prefixes built under keras.RematScope (recomputed in the backward "
        "pass), e.g. attn_,ffn_in_ for the GPT's attention and first FFN layer of every "
        "block, attn_[0-2] for blocks 0-2 only; JAX only: Keras' RematScope does not run in "
        "TensorFlow's compiled step (default: none)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="kmp.recompute_elementwise on every keras_mp and stock row's model (JAX): matmul "
        "and attention outputs kept for the backward pass, the element-wise work recomputed",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=0,
        help="seconds: start no configuration after this (0: no limit); skipped ones get a "
        "record with an error",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every configuration in this process (tests; less isolated)",
    )
    p.add_argument("--one", nargs=2, metavar=("MODEL", "POLICY"), help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> tuple[list, list]:
    """Checks parsed harness arguments before anything runs.

    Returns:
        `(models, policies)`: the names to run, policies in run order (`POLICIES`).

    Raises:
        ValueError: on an unknown model or policy name (the message lists the valid ones),
            a malformed `--env`, or a count out of range.
    """
    for flag in ("steps", "timeout"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1. Received: {getattr(args, flag)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0. Received: {args.warmup}")
    models = _names("model", args.models, WORKLOADS)
    order = list(POLICIES)
    policies = sorted(
        _names("policy", args.policies, POLICIES), key=lambda p: order.index(p.split("@")[0])
    )
    _env_pairs(args.env)
    # each subprocess would die in Keras' import
    check_backend_installed(backend=None if args.backend == configured_backend() else args.backend)
    if args.in_process and args.backend != os.environ.get("KERAS_BACKEND", "tensorflow"):
        raise ValueError("--in-process runs on this process's backend: set KERAS_BACKEND.")
    return models, policies


def _measure(args, model_name: str, policy: str) -> dict:
    return run_one(
        model_name,
        policy,
        args.steps,
        args.warmup,
        args.jit,
        args.keep_fp32,
        args.intra_op,
        args.inter_op,
        args.remat_layers,
        args.recompute,
    )


def run_configurations(args: argparse.Namespace, on_start=None, on_row=None) -> list:
    """Measures every configuration of parsed harness arguments; appends each to `--out`.

    Args:
        args: parsed arguments (`add_arguments`).
        on_start: optional; called as `on_start(model, policy)` before each configuration.
        on_row: optional; called with each record (speedups added) once it is measured.

    Returns:
        The records in run order; a failed or skipped configuration's has an `error`.

    Raises:
        ValueError: as `check`, before anything runs.
    """
    models, policies = check(args)
    rows, start = [], time.monotonic()
    for model_name in models:
        for policy in policies:
            if on_start is not None:
                on_start(model_name, policy)
            if args.budget and time.monotonic() - start > args.budget:
                row = {"error": f"skipped: --budget {args.budget:g} s spent"}
            elif args.in_process:
                row = _measure(args, model_name, policy)
            else:
                row = _subprocess(args, model_name, policy)
            if "error" in row:
                base, _, suffix = policy.partition("@")
                row = {"model": model_name, "policy": base, "xla_remat": suffix == "remat", **row}
            else:
                add_speedups(row, rows)
            rows.append(row)
            emit(row, args.out, echo=False)
            if on_row is not None:
                on_row(row)
    return rows


def main(argv=None) -> int:
    """Runs the harness: one JSON line per configuration on stdout, a Markdown table on
    stderr; returns the exit status (1 if a configuration failed).

    Raises:
        ValueError: on an unknown model or policy name (the message lists the valid ones).
    """
    args = build_parser().parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(_measure(args, *args.one)), flush=True)
        return 0
    rows = run_configurations(args, on_row=lambda row: print(json.dumps(row), flush=True))
    print(_table(rows), file=sys.stderr, flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
