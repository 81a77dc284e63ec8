"""The zoo sweep: every model of tests/integration/zoo.py through kmp.convert's stages.

For each entry and policy it runs `convert_stages.run` (convert, forward within tolerance
of float32, three fit steps, .keras round trip, audit); where a stage fails it also runs
the same model under stock Keras mixed precision, to tell keras_mp's failures from the ones
stock Keras shares. Results go to a JSON-lines file (one line per entry and policy; a rerun
skips what is there) and, with --markdown, to a table (family x stage) for docs/zoo.md.

Usage:

    KERAS_BACKEND=tensorflow python scripts/zoo_sweep.py --out runs/zoo_tf.jsonl
    KERAS_BACKEND=jax python scripts/zoo_sweep.py --tags decoder_lm --policies mixed_bfloat16 \\
        --out runs/zoo_jax.jsonl
    python scripts/zoo_sweep.py --markdown docs/zoo.md runs/zoo_tf.jsonl runs/zoo_jax.jsonl
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "integration"))


# What the zoo page says about the models keras_mp needed more than its keep-list for.
_STORY = (
    "Models stock Keras mixed precision cannot train (marked **stock Keras fails** below, "
    "with the pins keras_mp added beyond its keep-list and their share of the matmul "
    "FLOPs) train under keras_mp: `kmp.convert`'s run check ([converting.md]"
    "(converting.md#layers-that-cannot-run-in-the-low-dtype-the-run-check)) pins the "
    "layers that raise in float16 alone (ESM's `ESMRotaryEmbedding`, ESM-2 being the same "
    "class, RoFormer V2's position embedding, D-FINE's encoder and anchor generator, SAM 3's "
    "DETR decoder, Flux's timestep embedding: each builds a `range` in float16), and, on "
    "TensorFlow, compiles one gradient step "
    "for models that resize bilinearly and pins the resizing layers whose XLA gradient "
    "fails in float16 and bfloat16 (DeepLabV3, SegFormer, BASNet's 15 `UpSampling2D` "
    "layers); none of these pins has a matmul. Where float16 outputs are non-finite at "
    "random initialisation, calibration "
    "pins the smallest part that the converted model, run again, confirms "
    "([calibration.md](calibration.md)): in the T5 family, each attention layer's own math "
    "(its padding mask times -1e9 is NaN in float16): 0.0% of T5's matmul FLOPs run in "
    "float32 (100% before). T5Gemma's blocks make that mask themselves and RWKV-7's time "
    "mix overflows in its own recurrence; both blocks combine their sublayers' outputs with "
    "raw TensorFlow ops, which refuse a float32 tensor beside a float16 one, so the float16 "
    "sublayers of a block pinned alone cast their outputs to float32 at its boundary: "
    "T5Gemma, T5Gemma 2 and RWKV-7 pin their blocks' own math (the mask, the residual adds; "
    "RWKV-7's recurrence), 0.0% of their matmul FLOPs in float32 (100%, 100% and 80% when "
    "the pins grew to whole blocks). The convert stage calibrates on the "
    "entry's batch where plain conversion gives non-finite outputs (`calibrate=batch` in the "
    "note; T5's own check batch already shows it), as a user would. A failure left is "
    "marked with what float32 or stock Keras does on the same model: SAM 3 converts and "
    "runs forward with its DETR decoder's own math pinned, but its training step meets an op "
    "XLA:CPU does not compile (`ResizeNearestNeighborGrad`), in float32 too; Moonshine's "
    "reload is stock Keras' failure too (its config writes its dtype as float32). D-FINE's "
    "`.keras` reload under mixed_float16 now passes: a loaded model keeps a pin of a "
    "layer's own math alone where its saved map holds its sublayers' low policies, so "
    "sublayers that get their path only at their first call stay low. D-FINE's outputs "
    "differ from float32's by 1.2 (mixed_float16) and 1.6 (mixed_bfloat16, no pins, as "
    "stock Keras' own) of their largest value at random initialisation (its forward stage "
    "passes by the stock-Keras clause, not by closeness): its query selection is "
    "discontinuous at this scale in float32 itself, where a relative perturbation of the "
    "input of 1e-3 moves the outputs by 4.8e-3 of their largest value and one of 4e-3 "
    "(bfloat16's rounding) by 1.16; its three float16 steps leave the "
    "loss at 23.25 because the scaler skips them while it backs off from 2^15 to 2^12, after "
    "which it trains (23.25 to 17.5 in 20 steps, run apart). BASNet's mixed_float16 audit took "
    "27 minutes on this CPU (eager float16 convolution gradients run oneDNN's reference "
    "kernel).",
)


def _done(path: str) -> set:
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        return {(r["entry"], r["policy"]) for r in map(json.loads, f) if r.get("backend")
                == os.environ["KERAS_BACKEND"]}


def sweep(args) -> int:
    import convert_stages
    import keras
    import zoo

    backend = keras.backend.backend()
    entries = zoo.select(tags=args.tags, names=args.names)
    entries = [e for e in entries if backend in e.backends]
    done = _done(args.out)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for entry in entries:
        for policy in args.policies:
            if (entry.name, policy) in done:
                continue
            start = time.perf_counter()
            try:
                row = convert_stages.run(entry, policy, jit=backend == "tensorflow")
            except Exception as e:  # noqa: BLE001 - the float32 build itself failed
                row = {"entry": entry.name, "policy": policy, "build": str(e)[:240]}
            failed = [s for s in convert_stages.STAGES if row.get(s) not in (None, "ok", "-")]
            if failed or "build" in row or row.get("pin_detail") or row.get("calibrated"):
                # Pins beyond the keep-list: does stock Keras train this model at all?
                row["stock"] = convert_stages.stock(entry, policy)
            if failed or "build" in row:
                row["float32"] = convert_stages.float32(entry)
            row.update(backend=backend, family=entry.family, kind=entry.kind,
                       seconds=round(time.perf_counter() - start, 1))
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            status = "ok" if not failed and "build" not in row else f"FAILED {failed}"
            print(f"{entry.name:45s} {policy:15s} {row['seconds']:6.1f}s {status}", flush=True)
    return 0


def _status(row: dict) -> str:
    """"pass"; "rescued" (passes, stock Keras mixed precision fails); "float32" (fails
    where the float32 model fails too); "stock" (fails where stock Keras fails too, float32
    not run or fine); or "fail"."""
    import convert_stages

    failed = "build" in row or any(
        row.get(s) not in (None, "ok", "-") for s in convert_stages.STAGES
    )
    if not failed:
        return "rescued" if row.get("stock", "ok") != "ok" else "pass"
    if row.get("float32", "ok") != "ok":
        return "float32"
    return "stock" if row.get("stock", "ok") != "ok" else "fail"


def _pins_note(row: dict) -> str:
    """The pins beyond the keep-list, each with its share of the matmul FLOPs."""
    parts = []
    for p in row.get("pin_detail") or []:
        cost = "" if p.get("cost") is None else f", {100 * p['cost']:.1f}%"
        why = "run check" if p["reason"].startswith("run check") else "calibration"
        parts.append(f"{p['class']} ({why}{cost})")
    counts = {}
    for part in parts:
        counts[part] = counts.get(part, 0) + 1
    text = "; ".join(f"{n}× {k}" if n > 1 else k for k, n in counts.items())
    share = row.get("check_fp32_flops", row.get("calibration_fp32_flops"))
    if share is not None and text:
        text += f"; {100 * share:.1f}% of matmul FLOPs in float32"
    if row.get("calibrated"):
        text = "calibrate=batch; " + text
    return text


def markdown(paths: list, out: str) -> int:
    """Writes the coverage page: counts, then one row per model, backend and policy."""
    import platform

    import convert_stages
    import keras

    rows = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                rows[(r["entry"], r["backend"], r["policy"])] = r  # a rerun's row wins
    rows = sorted(rows.values(), key=lambda r: (r["entry"], r["backend"], r["policy"]))
    versions = {"keras": keras.__version__}
    for name in ("keras_hub", "tensorflow", "jax"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    stages = convert_stages.STAGES
    lines = [
        "# Model coverage: which models convert",
        "",
        f"Generated by `scripts/zoo_sweep.py` on {time.strftime('%Y-%m-%d')} "
        f"({platform.machine()} CPU; "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + "). Every model of "
        "`tests/integration/zoo.py`, built tiny from explicit arguments (no download), goes "
        "through `kmp.convert` and its stages: **convert** (original untouched, master weights "
        "bit-identical, layers as planned), **forward** (within "
        + ", ".join(f"{v:g} under {k}" for k, v in convert_stages.TOLERANCE.items())
        + " of the float32 outputs, relative to their largest value, or no worse than stock "
        "Keras' own mixed precision), **fit** (three steps, `kmp.LossScaleOptimizer` under "
        "mixed_float16, `kmp.losses` for logits, XLA on TensorFlow, finite losses), **save** "
        "(`.keras` round trip: weights, dtypes, outputs), **audit** (`kmp.audit` runs). Where "
        "keras_mp pinned layers beyond its keep-list (its run check, or calibration on the "
        "entry's batch where float16 outputs were non-finite), or a stage fails, the same "
        "model is also trained under stock Keras mixed precision; where a stage fails, the "
        "float32 model is trained too.",
        "",
        *_STORY,
        "",
        "A relative error of 1.0 that stock Keras shares (the `keras.applications` "
        "MobileNets under mixed_float16) is not a wrong result: at random initialisation "
        "and 32×32 inputs their float32 outputs are tiny (MobileNetV2's largest is 2e-11), "
        "below float16's smallest subnormal (6e-8), so any float16 model outputs zeros.",
        "",
    ]
    lines += ["Records (one JSON line per model, backend and policy): "
              + ", ".join(f"`{os.path.relpath(p)}`" for p in paths) + ".", ""]
    summary = {}
    kinds = ("pass", "rescued", "float32", "stock", "fail")
    for r in rows:
        key = (r["backend"], r["policy"])
        summary.setdefault(key, dict.fromkeys(kinds, 0))[_status(r)] += 1
    lines += ["| backend | policy | models | pass | of them, train under keras_mp where stock "
              "Keras fails | fail where float32 fails too | fail where stock Keras fails too "
              "| fail |",
              "|---|---|---|---|---|---|---|---|"]
    for (backend, policy), c in sorted(summary.items()):
        lines.append(f"| {backend} | {policy} | {sum(c.values())} | "
                     f"{c['pass'] + c['rescued']} | {c['rescued']} | {c['float32']} | "
                     f"{c['stock']} | {c['fail']} |")
    import zoo

    swept = {(r["entry"], r["backend"], r["policy"]) for r in rows}
    for (backend, policy) in sorted(summary):
        # JAX runs the decoder LMs (its CPU has no float16 dot; the rest is backend-neutral).
        scope = [e for e in zoo.ENTRIES if backend in e.backends
                 and (backend != "jax" or "decoder_lm" in e.tags)]
        missing = [e.name for e in scope if (e.name, backend, policy) not in swept]
        what = "decoder LMs" if backend == "jax" else "entries"
        lines += ["", f"{backend}, {policy}: {len(scope) - len(missing)} of the zoo's "
                  f"{len(scope)} {what} swept" + (
                      f"; not in this run: {', '.join(missing)}." if missing else ".")]
    lines += [
        "",
        "| model | backend | policy | " + " | ".join(stages) + " | rel. error | note |",
        "|---|---|---|" + "---|" * len(stages) + "---|---|",
    ]
    for r in rows:
        cells = ["✓" if r.get(s) == "ok" else ("" if r.get(s) in (None, "-") else "✗")
                 for s in stages]
        err = r.get("relative_error")
        status = _status(r)
        detail = r.get("build") or next(
            (r[s] for s in stages if r.get(s) not in (None, "ok", "-")), "")
        if status == "stock":
            note = ("stock Keras fails too: " + r.get("stock", ""))[:110]
        elif status == "float32":
            note = ("float32 fails too: " + r.get("float32", ""))[:110]
        elif status == "fail":
            note = detail[:110]
        elif status == "rescued":
            note = ("**stock Keras fails** (" + r.get("stock", "")[:60] + "); pins: "
                    + _pins_note(r))
        else:
            note = "; ".join(x for x in (_pins_note(r), r.get("save_note", "")[:110]) if x)
        lines.append(
            f"| {r['entry']} | {r['backend']} | {r['policy']} | " + " | ".join(cells)
            + f" | {'' if err is None else f'{err:.1e}'} | {note.replace('|', '/')} |"
        )
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(rows)} rows -> {out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tags", nargs="*", default=None)
    parser.add_argument("--names", nargs="*", default=None)
    parser.add_argument("--policies", nargs="*", default=["mixed_float16", "mixed_bfloat16"])
    parser.add_argument("--out", default="runs/zoo.jsonl")
    parser.add_argument("--markdown", metavar="MD", help="write the table of the given files")
    parser.add_argument("files", nargs="*", help="with --markdown: the JSON-lines files")
    args = parser.parse_args()
    if args.markdown:
        return markdown(args.files, args.markdown)
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
