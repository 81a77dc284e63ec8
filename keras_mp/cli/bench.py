"""`keras-mp bench`: the performance harness (`keras_mp.cli.benchmark`) for a person to read.

One progress bar per configuration (each runs in its own process), a table of the records,
and one verdict line: for each model, the fastest low-precision row against the best
float32 row. `--out FILE` appends one JSON record per configuration to FILE, as the harness
does; `--json` prints them on stdout and moves the rest to stderr.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Iterator

__all__ = ["format_table", "progress_bars", "run", "verdict"]


def _label(row: dict) -> str:
    jit = row.get("jit_compile")
    xla = (
        ""
        if jit is None
        else (" (XLA, remat)" if row.get("xla_remat") else " (XLA)" if jit else " (no XLA)")
    )
    return f"{row['policy']}{xla}"


def _num(value, fmt: str) -> str:
    return "" if value is None or not math.isfinite(value) else format(value, fmt)


def _ratio(value) -> str:
    return "" if value is None else f"{value:.2f}×"


def _memory(row: dict) -> str:
    text = f"{row['peak_mem_gib']:.2f} GiB " + (
        "RSS" if row["peak_mem_kind"] == "host_rss" else "device"
    )
    if "tensor_peak_mib" in row:
        text += f" (tensors {row['tensor_peak_mib']:.3g} MiB)"
    return text


def format_table(rows: list):
    """The records as a `rich.table.Table`, one row per configuration."""
    from rich.table import Table

    device = next((r["device"] for r in rows if "device" in r), "")
    backend = next((r["backend"] for r in rows if "backend" in r), "")
    table = Table(
        title=f"train steps on {device}" + (f", {backend} backend" if backend else ""),
        caption="× FP32: against the float32 row of the same model and XLA setting; "
        "× best FP32: against the model's fastest float32 row; × stock: against stock "
        "Keras with the same dtype policy. > 1 is faster. peak mem: device peak on GPUs, "
        "process RSS on CPUs (TensorFlow's tensor peak in parentheses).",
        caption_justify="left",
    )
    for name in (
        "model",
        "policy",
        "step ms",
        "throughput",
        "TFLOP/s",
        "peak mem",
        "× FP32",
        "× best FP32",
        "× stock",
    ):
        table.add_column(name, justify="left" if name in ("model", "policy") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], _label(r), "[bold red]error[/]", *[""] * 6)
            continue
        table.add_row(
            r["model"],
            _label(r),
            _num(r["step_ms_median"], ".1f"),
            f"{r['units_per_s']:.0f} {r['units']}/s",
            _num(r["tflops"], ".3g"),
            _memory(r),
            _ratio(r.get("speedup_vs_fp32")),
            _ratio(r.get("speedup_vs_best_fp32")),
            _ratio(r.get("speedup_vs_stock")),
        )
    return table


def _model_verdict(model: str, rows: list) -> str:
    from keras_mp.cli.measure import POLICIES

    ran = [r for r in rows if "error" not in r]
    if not ran:
        return f"{model}: no configuration ran"
    low = [r for r in ran if POLICIES.get(r["policy"]) != "float32"]
    if not low:
        best = min(ran, key=lambda r: r["step_ms_median"])
        return f"{model}: {_label(best)} is fastest, {best['step_ms_median']:.1f} ms/step"
    best = min(low, key=lambda r: r["step_ms_median"])
    gain = best.get("speedup_vs_best_fp32")
    if gain is None:
        return (
            f"{model}: {_label(best)} is the fastest low-precision row, "
            f"{best['step_ms_median']:.1f} ms/step (no float32 row to compare with)"
        )
    if gain <= 1:
        return f"{model}: no low-precision row beats float32 (best {_label(best)}, {gain:.2f}×)"
    stock = best.get("speedup_vs_stock")
    vs_stock = (
        f", {stock:.2f}× stock Keras" if stock and best["policy"].startswith("keras_mp_") else ""
    )
    return f"{model}: {_label(best)} is {gain:.2f}× the best float32 step{vs_stock}"


def verdict(rows: list) -> str:
    """One line: per model, the fastest low-precision row against the best float32 row,
    and how many configurations failed."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    parts = [_model_verdict(m, [r for r in rows if r["model"] == m]) for m in models]
    failed = sum("error" in r for r in rows)
    if failed:
        parts.append(f"{failed} of {len(rows)} configurations failed")
    return "verdict: " + ("; ".join(parts) or "nothing ran") + "."


@contextlib.contextmanager
def progress_bars(con, enabled: bool = True) -> Iterator:
    """Yields `(on_start, on_row)` callbacks that draw one rich bar per configuration."""
    if not enabled:
        yield None, None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description:<40}"),
        BarColumn(bar_width=20),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
        console=con,
        transient=False,
    )
    current = []

    def on_start(model: str, policy: str):
        current.append(bars.add_task(f"{model} {policy}", total=1, note=""))

    def on_row(row: dict):
        if "error" in row:
            note = "error: " + " ".join(row["error"].split())[:70]
        else:
            fp32 = row.get("speedup_vs_best_fp32")
            note = f"{row['step_ms_median']:.1f} ms/step" + (
                f", {fp32:.2f}× best FP32" if fp32 else ""
            )
        bars.update(current[-1], completed=1, note=note)

    with bars:
        yield on_start, on_row


def run(args) -> int:
    """Runs `keras-mp bench` from parsed arguments; returns the exit status (1 if a
    configuration failed)."""
    from keras_mp.cli import benchmark, startup
    from keras_mp.cli.report import console

    benchmark.check(args)
    startup.quiet_environment(args.verbose)  # the configurations' processes inherit it
    if args.in_process:
        startup.start(verbose=args.verbose)
    con = console(sys.stderr if args.json else sys.stdout)
    with progress_bars(con, enabled=not args.no_progress) as (on_start, on_row):

        def record(row):
            if args.json:
                print(json.dumps(row), flush=True)
            if on_row is not None:
                on_row(row)

        rows = benchmark.run_configurations(args, on_start=on_start, on_row=record)
    con.print(format_table(rows))
    for r in rows:
        if "error" in r:
            message = " ".join(r["error"].split())[-300:]
            con.print(f"error: {r['model']} {_label(r)}: {message}", markup=False, soft_wrap=True)
    if args.out:
        con.print(f"records: {args.out}")
    con.print(verdict(rows), markup=False, soft_wrap=True)
    return 1 if any("error" in r for r in rows) else 0
