"""The `keras-mp compare` command: progress bars, the rich table, results.json, the plot."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator

__all__ = ["console", "format_table", "notes", "progress_bars", "run", "write_plot"]


def console(file=None):
    """A rich console; at least 150 columns wide when the output is not a terminal."""
    from rich.console import Console

    file = file or sys.stdout
    width = None if file.isatty() else max(150, int(os.environ.get("COLUMNS", 0) or 0))
    return Console(file=file, width=width, highlight=False)


def _pct(v, signed=False) -> str:
    if v is None or not math.isfinite(v):
        return "n/a" if v is None else str(v)
    return f"{100 * v:+.1f}" if signed else f"{100 * v:.1f}%"


def _num(v, fmt: str, dash: str = "n/a") -> str:
    if v is None:
        return dash
    return format(v, fmt) if math.isfinite(v) else str(v)


def _memory(v) -> str:
    return "n/a" if v is None else f"{v / 2**20:.1f} MiB"


_STYLES = {
    "matches FP32": "green",
    "reference": "bold",
    "higher": "green",
    "lower": "yellow",
    "stalled": "red",
    "diverged": "bold red",
    "error": "bold red",
}


def _memory_reported(results: dict) -> bool:
    return any(r.get("peak_memory_bytes") is not None for r in results["rows"])


def _memory_caption(results: dict) -> str:
    """What the `peak mem` column shows, or, once, that the backend reports nothing."""
    env = results.get("environment", {})
    if not _memory_reported(results):
        return (
            f"peak memory: not reported by the {env.get('backend', 'this')} backend on this "
            "device (no column)."
        )
    source = env.get("peak_memory_source") or "device peak where the backend reports it"
    return f"peak mem: {source}."


def format_table(results: dict):
    """The comparison as a `rich.table.Table` (one row per precision mode)."""
    from rich.table import Table

    cfg, data, thr = results["config"], results["data"], results["thresholds"]
    title = (
        f"{cfg['model']} on {data['name']}: {data['train_samples']} train / "
        f"{data['val_samples']} val, {cfg['epochs']} epochs, batch {cfg['batch_size']}, "
        f"{cfg['optimizer']} lr {cfg['lr']:g} ({cfg['schedule']}), "
        f"{results['environment']['backend']} backend"
    )
    caption = (
        f"Δ acc: points vs float32. verdict: |Δ acc| ≤ {100 * thr['match_accuracy']:.1f} "
        f"points = matches FP32; lower with ≥ {100 * thr['stalled_frozen_fraction']:.0f}% "
        f"of weights unchanged over the last epoch (updates rounded away; not the lean "
        f"state, whose roundings are unbiased) = stalled; "
        f"non-finite loss or final train loss > {thr['diverged_loss_growth']:g}× the first "
        f"epoch's = diverged. compile: xla = jit_compile=True, default = Keras' choice. "
        f"{_memory_caption(results)} "
        f"state B/p: bytes of persistent training state (weights, compensation, optimizer "
        f"state, scaler) per parameter, exact from the variables (kmp.state_bytes)."
    )
    table = Table(title=title, caption=caption, caption_justify="left")
    memory = _memory_reported(results)
    for name, justify in [
        ("mode", "left"),
        ("compile", "left"),
        ("val acc", "right"),
        ("Δ acc", "right"),
        ("val loss", "right"),
        ("steps/s", "right"),
        ("× FP32", "right"),
        *([("peak mem", "right")] if memory else []),
        ("state B/p", "right"),
        ("skipped", "right"),
        ("loss scale", "right"),
        ("frozen", "right"),
        ("verdict", "left"),
    ]:
        table.add_column(name, justify=justify)
    for r in results["rows"]:
        style = _STYLES.get(r["verdict"], "")
        table.add_row(
            r["label"],
            r["compile"],
            _num(r["val_accuracy"], ".3f"),
            _pct(r["accuracy_diff"], signed=True),
            _num(r["val_loss"], ".4f"),
            _num(r["steps_per_second"], ".1f"),
            _num(r["speed_ratio"], ".2f"),
            *([_memory(r["peak_memory_bytes"])] if memory else []),
            _num(r.get("state_bytes_per_parameter"), ".2f"),
            _num(r["skipped_steps"], "d", dash="—"),
            _num(r["final_loss_scale"], ".0f", dash="—"),
            _pct(r["frozen_fraction"]),
            f"[{style}]{r['verdict']}[/]" if style else r["verdict"],
        )
    return table


@contextlib.contextmanager
def progress_bars(con, enabled: bool = True) -> Iterator:
    """Yields a `(policy, total_steps) -> (advance, done)` factory drawing rich bars."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bars = Progress(
        TextColumn("{task.description:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
        console=con,
        transient=False,
    )

    def factory(policy: str, total: int):
        task = bars.add_task(policy, total=total, note="")

        def done(row):
            note = row.get("error") or (
                f"val acc {row['val_accuracy']:.3f}  loss {row['val_loss']:.4f}"
            )
            bars.update(task, completed=total, note=note[:80])

        return (lambda: bars.advance(task)), done

    with bars:
        yield factory


def write_plot(results: dict, path: str) -> str:
    """Writes a PNG of the loss curves and the loss-scale trajectory; returns `path`."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - matplotlib is in the `plot` extra
        raise ValueError("--plot needs matplotlib: pip install 'keras_mp[plot]'.") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax_train, ax_val, ax_frozen, ax_scale = axes.ravel()
    for i, r in enumerate(results["rows"]):
        h, color = r["history"], f"C{i}"
        if not h:  # the mode failed
            continue
        epochs = range(1, len(h["train_loss"]) + 1)
        ax_train.plot(epochs, h["train_loss"], ".-", color=color, label=r["label"])
        ax_val.plot(epochs, h["val_loss"], ".-", color=color, label=r["label"])
        frozen = [100 * f for f in h["frozen_fraction"]]
        ax_frozen.plot(epochs, frozen, ".-", color=color, label=r["label"])
        if "loss_scale" in h:
            ax_scale.step(
                h["loss_scale"]["step"],
                h["loss_scale"]["value"],
                color=color,
                where="post",
                label=r["label"],
            )
    for ax, title in [(ax_train, "train loss"), (ax_val, "validation loss")]:
        ax.set(title=title, xlabel="epoch", yscale="log")
    ax_frozen.set(
        title="weights left unchanged by the epoch (%): updates lost to rounding",
        xlabel="epoch",
        ylim=(-3, 103),
    )
    ax_scale.set(title="loss scale (LossScaleOptimizer)", xlabel="step", yscale="log")
    if not ax_scale.lines:
        ax_scale.text(0.5, 0.5, "no loss-scaled mode", ha="center", transform=ax_scale.transAxes)
    for ax in axes.ravel():
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    cfg = results["config"]
    fig.suptitle(
        f"keras-mp compare: {cfg['model']}, {cfg['optimizer']} lr {cfg['lr']:g} "
        f"({cfg['schedule']}), {cfg['epochs']} epochs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


_ROUNDING = {
    "stochastic": "bfloat16 weights rounded stochastically (unbiased: updates below their "
    "ulp add up on average)",
    "kahan": "bfloat16 weights whose rounding error is kept in an 8-bit compensation buffer",
    "kahan16": "bfloat16 weights whose rounding error is kept in a bfloat16 compensation buffer",
}
_MOMENTS = {"int4": "4-bit", "int8": "8-bit", "bfloat16": "bfloat16", "float32": "float32"}


def _lean_state(state: dict | None) -> str:
    """What a lean row's state stores (`results.json`'s `lean_state`; records written
    before it existed were kahan + int8, the default until 2026-12-03)."""
    state = state or {"rounding": "kahan", "moments": "int8"}
    rounding = _ROUNDING.get(state.get("rounding"), "bfloat16 weights")
    return f"{rounding}, {_MOMENTS.get(state.get('moments'), 'compact')} moments"


def notes(rows: list[dict], cfg) -> list[str]:
    """Plain-language explanations of the pure-mode rows, from the measured values.

    Args:
        rows: the results rows (with verdicts).
        cfg: the `keras_mp.cli.settings.CompareConfig`.

    Returns:
        A list of sentences (possibly empty).
    """
    import keras_mp.formats as formats
    from keras_mp.cli.compare import THRESHOLDS, is_lean

    out = []
    ref = next((r for r in rows if r["policy"] == "float32"), None)
    for r in rows:
        if r.get("error"):
            out.append(f"{r['label']} failed: {r['error']}")
            continue
        if r["policy"] == "mixed_float16_calibrated":
            share = r.get("fp32_flops")
            cost = "" if share is None else f" ({100 * share:.1f}% of the matmul FLOPs)"
            out.append(
                f"{r['label']}: kmp.convert(model, 'mixed_float16', calibrate=training "
                f"batches) pinned {len(r['fp32_pins'])} layer(s) to float32{cost}: "
                f"{', '.join(r['fp32_pins'][:6])}{' ...' if len(r['fp32_pins']) > 6 else ''}."
            )
            continue
        if (
            r["policy"] == "mixed_float16"
            and r.get("skipped_steps")
            and not _finite(r.get("val_loss"))
        ):
            out.append(
                f"{r['label']}: activations pass float16's 65,504 (inf in the forward pass): "
                f"every step skipped ({r['skipped_steps']}); the loss scale cannot help. "
                "`keras-mp audit MODEL --data BATCH.npz` names the layers, "
                "`kmp.convert(..., calibrate=data)` pins them."
            )
            continue
        if is_lean(r) and r.get("state_bytes_per_parameter"):
            mixed = next((m for m in rows if m["policy"] == "mixed_bfloat16"), None)
            than = (
                f" (mixed bfloat16: {mixed['state_bytes_per_parameter']:.2f})"
                if mixed and mixed.get("state_bytes_per_parameter")
                else ""
            )
            out.append(
                f"{r['label']}: {r['state_bytes_per_parameter']:.2f} bytes of training state a "
                f"parameter{than}: {_lean_state(r.get('lean_state'))}, updates computed in "
                "float32 (kmp.LeanOptimizer)."
            )
            frozen = r.get("frozen_fraction")
            if frozen is not None and frozen >= THRESHOLDS["stalled_frozen_fraction"]:
                out.append(
                    f"{r['label']}: {100 * frozen:.1f}% of the weights kept their bits over the "
                    "last epoch, and that is no stall: the lean roundings are unbiased, so an "
                    "update smaller than a bfloat16 step moves its weight one step with a "
                    "probability in proportion to its size, and a weight moves as float32 "
                    "would on average."
                )
            continue
        if r["policy"] not in ("float16", "bfloat16"):
            continue
        dtype = r["policy"]
        if cfg.optimizer == "adam" and formats.round_to(0.999, dtype) == 1.0:
            out.append(
                f"{r['label']}: Adam's beta_2 = 0.999 rounds to 1.0 in {dtype}, so Keras' "
                f"bias-corrected step lr*sqrt(1 - beta_2**t)/(1 - beta_1**t) is exactly 0 "
                f"when computed in {dtype}: no weight can move."
            )
        elif r["verdict"] == "stalled":
            frozen = r["history"]["frozen_fraction"]
            mid = frozen[len(frozen) // 2]
            ref_text = f" (float32: {100 * ref['frozen_fraction']:.1f}%)" if ref else ""
            out.append(
                f"{r['label']}: {100 * r['frozen_fraction']:.1f}% of the weights did not change "
                f"in the last epoch{ref_text}, {100 * mid:.1f}% at mid-run: updates smaller "
                f"than half a {dtype} ulp of the weight are rounded away; the mixed modes "
                f"apply them to FP32 master weights."
            )
    return out


def _json_default(value):
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def run(args) -> int:
    """Runs `keras-mp compare` from parsed arguments; returns the exit status."""
    from keras_mp.cli.compare import run_compare
    from keras_mp.cli.compare_speed import speed_notes
    from keras_mp.cli.settings import config_from_args

    cfg = config_from_args(args)
    os.makedirs(args.out, exist_ok=True)
    con = console()
    with progress_bars(con, enabled=not args.no_progress) as factory:
        results = run_compare(cfg, progress=factory)
    results["notes"] = notes(results["rows"], cfg) + speed_notes(results)
    con.print(format_table(results))
    for note in results["notes"]:
        con.print(f"note: {note}")
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=_json_default, allow_nan=True)
    con.print(f"results: {path}  (total {results['wall_seconds']:.0f} s)")
    if args.plot:
        con.print(f"plot: {write_plot(results, os.path.join(args.out, 'loss_curves.png'))}")
    return 0
