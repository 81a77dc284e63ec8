"""Checks the model zoo (tests/integration/zoo.py) in float32: build, forward, fit.

For each selected entry: build it, run `predict_on_batch(inputs(2))` (finite?), compile
with `Adam(1e-3)` and the entry's loss, and `fit` for 2 steps (batch 2). On TensorFlow
`fit` first tries `jit_compile=True` and falls back to `jit_compile=False`; the table
says which one ran. Prints one row per entry:

    name | build s | forward s | forward ok | fit ok | jit | error (first line)

With `--rebuild`, two more columns: `rebuild` (a second `build()` in the same session
gives the same weight paths, in the same order, with equal values) and `config`
(`from_config(get_config())` gives the same weight paths and shapes in the same order;
"n/a" where the model has no usable config). A mismatch reads "paths differ" (same
shapes in the same order, other paths: auto-generated names), "order differs",
"values differ" or "differs".

Usage:

    KERAS_BACKEND=tensorflow python scripts/zoo_check.py                  # everything
    KERAS_BACKEND=jax python scripts/zoo_check.py --tags decoder_lm
    python scripts/zoo_check.py --names hub.BertBackbone apps.MobileNetV2 --no-fit
    python scripts/zoo_check.py --tags core --json /tmp/zoo.json
"""

import argparse
import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "integration"))
import zoo  # noqa: E402

BATCH = 2
STEPS = 2


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def _finite(tree) -> bool:
    leaves = keras.tree.flatten(tree)
    floats = [np.asarray(x) for x in leaves if np.issubdtype(np.asarray(x).dtype, np.floating)]
    return all(np.isfinite(x).all() for x in floats)


def _fit(entry, model, jit_compile):
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=entry.loss(),
                  jit_compile=jit_compile)
    x, y = entry.fit_data(model, BATCH)  # one batch, STEPS times
    history = model.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0)
    losses = history.history["loss"]
    if not np.isfinite(losses).all():
        raise FloatingPointError(f"non-finite loss {losses}")
    return losses[-1]


def _weights(model):
    return [(v.path, tuple(v.shape)) for v in model.weights]


def _compare(reference, other, values=False):
    """"ok"; "paths differ" (same shapes in the same order, other paths: auto-generated
    names); "order differs" (same (path, shape) set, another order); "values differ";
    "differs" (other weights)."""
    a, b = _weights(reference), _weights(other)
    if a == b:
        if values and not all(
            np.array_equal(keras.ops.convert_to_numpy(x.value), keras.ops.convert_to_numpy(y.value))
            for x, y in zip(reference.weights, other.weights)
        ):
            return "values differ", ""
        return "ok", ""
    detail = _first_diff(a, b)
    if [s for _, s in a] == [s for _, s in b]:
        return "paths differ", detail
    if sorted(a) == sorted(b):
        return "order differs", detail
    return "differs", detail


def _rebuild_checks(entry, model, row):
    """Is a rebuild identical, and does the config round-trip (paths, shapes, order)?"""
    try:
        row["rebuild"], row["rebuild_detail"] = _compare(model, entry.build(), values=True)
    except Exception as error:  # noqa: BLE001
        row["rebuild"] = "error: " + _first_line(error)
    try:
        config = model.get_config()
    except Exception as error:  # noqa: BLE001
        row["config"] = "n/a: " + _first_line(error)
        return
    try:
        clone = type(model).from_config(config)
        if not clone.built:
            clone.build_from_config(model.get_build_config() or {})
        row["config"], row["config_detail"] = _compare(model, clone)
    except Exception as error:  # noqa: BLE001
        row["config"] = "error: " + _first_line(error)


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"#{i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"


def check(entry, do_fit=True, try_jit=True, rebuild=False) -> dict:
    """Builds, runs and fits one entry; returns a result row (never raises)."""
    row = {"name": entry.name, "kind": entry.kind, "build_s": None, "forward_s": None,
           "forward": False, "fit": None, "jit": None, "params": None, "error": ""}
    backend = keras.backend.backend()
    keras.backend.clear_session()
    gc.collect()
    keras.config.set_dtype_policy("float32")
    try:
        start = time.perf_counter()
        model = entry.build()
        row["build_s"] = round(time.perf_counter() - start, 2)
        row["params"] = int(model.count_params())
        start = time.perf_counter()
        out = model.predict_on_batch(entry.inputs(BATCH))
        row["forward_s"] = round(time.perf_counter() - start, 2)
        if not _finite(out):
            raise FloatingPointError("non-finite forward output")
        row["forward"] = True
    except Exception as error:  # noqa: BLE001 - a report, not a test
        row["error"] = "forward: " + _first_line(error)
        row["trace"] = traceback.format_exc()
        return row
    if rebuild:
        _rebuild_checks(entry, model, row)
    if not do_fit:
        return row
    jit_options = [True, False] if (backend == "tensorflow" and try_jit) else ["auto"]
    errors = []
    for jit in jit_options:
        try:
            model = entry.build()  # fresh model: a failed XLA attempt leaves state behind
            row["loss"] = float(_fit(entry, model, jit))
            row["fit"], row["jit"] = True, jit
            break
        except Exception as error:  # noqa: BLE001
            errors.append(f"jit={jit}: " + _first_line(error))
            row["trace"] = traceback.format_exc()
    else:
        row["fit"] = False
    if errors:
        row["error"] = " / ".join(errors)
    if row["fit"]:
        row.pop("trace", None)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tags", nargs="*", help="entries with any of these tags")
    parser.add_argument("--names", nargs="*", help="these entries")
    parser.add_argument("--kind", nargs="*", help="backbone, task, application, user")
    parser.add_argument("--no-fit", action="store_true", help="build and forward only")
    parser.add_argument("--no-jit", action="store_true", help="TensorFlow: skip jit_compile")
    parser.add_argument("--rebuild", action="store_true",
                        help="also check rebuild determinism and the config round-trip")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--traces", action="store_true", help="print tracebacks of failures")
    args = parser.parse_args(argv)

    backend = keras.backend.backend()
    entries = zoo.select(tags=args.tags, kind=args.kind, names=args.names, backend=backend)
    print(f"backend={backend} keras={keras.__version__} entries={len(entries)}", flush=True)
    print("name | build s | forward s | forward ok | fit ok | jit | error"
          + (" | rebuild | config" if args.rebuild else ""))
    rows = []
    for entry in entries:
        row = check(entry, do_fit=not args.no_fit, try_jit=not args.no_jit,
                    rebuild=args.rebuild)
        rows.append(row)
        line = (f"{row['name']} | {row['build_s']} | {row['forward_s']} | {row['forward']} | "
                f"{row['fit']} | {row['jit']} | {row['error']}")
        if args.rebuild:
            line += f" | {row.get('rebuild')} | {row.get('config')}"
        print(line, flush=True)
        if args.traces and "trace" in row:
            print(row["trace"], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    failed = [r["name"] for r in rows if not r["forward"] or r["fit"] is False]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed; failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
