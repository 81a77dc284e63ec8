"""Runs generated programs and prints the outcomes per family, and the failing programs.

    KERAS_BACKEND=tensorflow python -m tests.harness.sweep --n 200 --seed 0 --out report.json
    python -m tests.harness.sweep --program 'seed=7 family=dense policy=keras:bfloat16 ...'
    python -m tests.harness.sweep --calibrate --n 40   # float32 vs float32 (another weight
                                                       # seed) and known-good mixed programs

`--out` gets one JSON record per program (appended as each finishes, so a killed sweep keeps
what it ran).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from . import oracle, programs  # noqa: E402

KINDS = ("ok", "ok_warned", "ok_raised", "silent", "crash")


def _table(outcomes: list[oracle.Outcome]) -> str:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outcomes:
        counts[programs.Program.parse(o.program).family][o.kind] += 1
    rows = [f"{'family':<12}" + "".join(f"{k:>10}" for k in KINDS)]
    total: collections.Counter = collections.Counter()
    for fam in programs.FAMILIES:
        if fam in counts:
            rows.append(f"{fam:<12}" + "".join(f"{counts[fam][k]:>10}" for k in KINDS))
            total.update(counts[fam])
    rows.append(f"{'all':<12}" + "".join(f"{total[k]:>10}" for k in KINDS))
    return "\n".join(rows)


def calibrate(seeds: list[int]) -> None:
    """Distances that must pass: float32 vs float32 with another weight seed, and known-good
    mixed programs (fit, Adam, kmp.convert, no event)."""
    backend = programs.keras.backend.backend()
    for s in seeds:
        base = dataclasses.replace(
            programs.generate(s, backend),
            path="fit",
            event="none",
            wrap="plain",
            opt="adam",
            clip="none",
            weight="none",
            loss="kmp_sparse",
            jit="auto",
        )
        ref = programs.run(dataclasses.replace(base), precision="float32")
        other = programs.run(base, precision="float32", init_seed=s + 10_000)
        row = {"seed": s, "family": base.family}
        if ref.error or other.error:
            row["error"] = (ref.error or other.error)["message"][:200]
        else:
            row["fp32_reseed"] = oracle.distance(other.losses, ref.losses)
        for pol in ("convert:mixed_float16", "convert:mixed_bfloat16", "convert:lean_bfloat16"):
            low = programs.run(dataclasses.replace(base, policy=pol))
            if low.error is None and ref.error is None:
                row[pol.split(":")[1]] = oracle.distance(low.losses, ref.losses)
        print(json.dumps(row), flush=True)


def reclassify(path: str, out: str | None) -> int:
    """Classifies a report's recorded runs again with the current oracle (no training)."""
    outcomes = []
    for line in open(path):
        rec = json.loads(line)
        p = programs.Program.parse(rec["program"])
        low, ref = (programs.Run(**rec["runs"][k]) for k in ("low", "ref"))
        o = oracle.classify(p, low, ref)
        o.evidence["backend"] = rec["backend"]
        o.runs = rec["runs"]
        outcomes.append(o)
        if out:
            with open(out, "a") as f:
                new = {**rec, **dataclasses.asdict(o)}
                f.write(json.dumps(new, default=str) + "\n")
    print(_table(outcomes))
    _causes(outcomes)
    return 0


def _causes(outcomes: list[oracle.Outcome]) -> None:
    """The failing programs grouped by cause (the reason with its numbers blanked)."""
    groups: dict[str, list[oracle.Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        if o.failed:
            groups[f"{o.kind}: " + re.sub(r"\b\d[\d.e+-]*", "#", o.reason)].append(o)
    for cause, members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"\n{len(members):>4}  {cause}")
        for o in members[:40]:
            print(f"        [{o.evidence.get('backend', '?')[:3]}] {o.program}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=str, default=None, help="comma-separated seeds")
    ap.add_argument(
        "--program", type=str, default=None, help="one program, as describe() spells it"
    )
    ap.add_argument("--out", type=str, default=None)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--reclassify", type=str, default=None, help="a report.json to classify again")
    args = ap.parse_args(argv)
    backend = programs.keras.backend.backend()
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    else:
        seeds = list(range(args.seed, args.seed + args.n))
    if args.reclassify:
        return reclassify(args.reclassify, args.out)
    if args.calibrate:
        calibrate(seeds)
        return 0
    progs = (
        [programs.Program.parse(args.program)]
        if args.program
        else [programs.generate(s, backend) for s in seeds]
    )
    outcomes = []
    for p in progs:
        t = time.time()
        o = oracle.check(p)
        outcomes.append(o)
        took = time.time() - t
        print(f"{o.kind:<9} {took:5.1f}s  {p.describe()}  -- {o.reason}", flush=True)
        if args.out:
            with open(args.out, "a") as f:
                rec = {"backend": backend, "seconds": round(took, 2), **dataclasses.asdict(o)}
                f.write(json.dumps(rec, default=str) + "\n")
        if o.failed or args.program:
            print(o.report(), flush=True)
    print()
    print(_table(outcomes))
    _causes(outcomes)
    failed = [o for o in outcomes if o.failed]
    if failed:
        print(f"\n{len(failed)} failing program(s):")
        for o in failed:
            print(f"  {o.kind:<7} {o.reason}\n          {o.program}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
