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
            if failed or "build" in row:
                row["stock"] = convert_stages.stock(entry, policy)
            row.update(backend=backend, family=entry.family, kind=entry.kind,
                       seconds=round(time.perf_counter() - start, 1))
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            status = "ok" if not failed and "build" not in row else f"FAILED {failed}"
            print(f"{entry.name:45s} {policy:15s} {row['seconds']:6.1f}s {status}", flush=True)
    return 0


def markdown(paths: list, out: str) -> int:
    import convert_stages

    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f]
    stages = convert_stages.STAGES
    lines = [
        "| model | backend | policy | " + " | ".join(stages) + " | rel. error | stock Keras |",
        "|---|---|---|" + "---|" * len(stages) + "---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["entry"], r["backend"], r["policy"])):
        cells = ["✓" if r.get(s) == "ok" else ("" if r.get(s) in (None, "-") else "✗")
                 for s in stages]
        err = r.get("relative_error")
        lines.append(
            f"| {r['entry']} | {r['backend']} | {r['policy']} | " + " | ".join(cells)
            + f" | {'' if err is None else f'{err:.1e}'} | {r.get('stock', '')[:80]} |"
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
