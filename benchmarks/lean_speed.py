"""What the lean step costs: `lean_bfloat16` against `mixed_bfloat16`, side by side.

    python benchmarks/lean_speed.py                       # both backends, all sizes
    python benchmarks/lean_speed.py --backends jax --sizes 0.13M --rounds 3

For each backend (one subprocess each, `KERAS_BACKEND` set) and each model size, one
float32 model is built and converted to keras_mp's `mixed_bfloat16` and `lean_bfloat16`;
both copies are compiled with AdamW (`jit_compile` left to Keras: XLA on JAX, TensorFlow's
own kernels on a CPU) and warmed up. Then, `--rounds` times, each policy runs `--steps`
timed `train_on_batch` calls (synchronous: each returns a host float), the policies
alternating in ABBA order so that load on a shared machine hits both alike. A round's ratio
is lean's median step over mixed's median step; the table gives the median over rounds and
their spread (min-max). Only ratios are meaningful on a shared machine.

Sizes: byte-level GPTs (vocabulary 256, pre-LN decoder blocks with causal attention, 4
heads, FFN 4x, untied head) of about 0.13M, 1M and 3.3M parameters on 32 x 128-byte
batches (and, named in `--sizes` only, 25M and 101M for a GPU), and `compare`, the
14k-parameter transformer of `keras-mp compare --model transformer` (its data, batch 32,
Adam as `compare` uses).

Prints one JSON line per (backend, size) and a Markdown table at the end; `--out` writes
all of it as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SIZES = {
    # name: (layers, width); vocabulary 256, sequence 128
    "0.13M": (2, 64),
    "1M": (5, 128),
    "3.3M": (4, 256),
}
# on a GPU, where the update is memory-bound and launches are cheap (not in the default run)
LARGE_SIZES = {"25M": (8, 512), "101M": (8, 1024)}
DEFAULT_SIZES = (*SIZES, "compare")
ALL_SIZES = (*DEFAULT_SIZES, *LARGE_SIZES)
POLICIES = ("mixed_bfloat16", "lean_bfloat16")
# `--unpacked`: the lean step with each small variable's state in its own arrays too
UNPACKED = "lean_bfloat16:pack_small=False"
# `--pallas`: the lean step with the 4-bit update as one Pallas kernel a variable (JAX)
PALLAS = "lean_bfloat16:pallas"


def char_gpt(keras, layers_: int, width: int, length: int, vocab: int = 256):
    """A float32 pre-LN byte-level GPT (plain Keras layers)."""
    from keras import layers

    from keras_mp.cli.data import PositionEmbedding

    tokens = keras.Input((length,), dtype="int32", name="tokens")
    h = layers.Embedding(vocab, width, name="embed")(tokens)
    h = PositionEmbedding(length, name="positions")(h)
    for i in range(layers_):
        a = layers.LayerNormalization(name=f"ln_a{i}")(h)
        a = layers.MultiHeadAttention(4, width // 4, name=f"attn{i}")(a, a, use_causal_mask=True)
        h = layers.Add(name=f"res_a{i}")([h, a])
        f = layers.LayerNormalization(name=f"ln_f{i}")(h)
        f = layers.Dense(4 * width, activation="gelu", name=f"ffn_in{i}")(f)
        f = layers.Dense(width, name=f"ffn_out{i}")(f)
        h = layers.Add(name=f"res_f{i}")([h, f])
    h = layers.LayerNormalization(name="ln_out")(h)
    logits = layers.Dense(vocab, name="head")(h)
    return keras.Model(tokens, logits, name=f"char_gpt_{layers_}x{width}")


def _workload(size: str, args):
    """`(float32 model, x, y, optimizer factory)` of a size."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    if size == "compare":
        from keras_mp.cli.data import build_model, load_dataset

        data = load_dataset("transformer", seed=0)
        model = build_model("transformer", data, seed=0)
        x, y = data.x_train[:32], data.y_train[:32]
        return model, x, y, lambda: keras.optimizers.Adam(1e-3)
    layers_, width = {**SIZES, **LARGE_SIZES}[size]
    model = char_gpt(keras, layers_, width, args.length)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(args.batch, args.length)).astype("int32")
    y = rng.integers(0, 256, size=(args.batch, args.length)).astype("int32")
    return model, x, y, lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01)


def measure(size: str, args) -> dict:
    """Lean/mixed step-time ratios of one size, in this process's backend."""
    import keras
    import numpy as np

    import keras_mp as kmp

    base, x, y, make_optimizer = _workload(size, args)
    variants = POLICIES + ((UNPACKED,) if args.unpacked else ())
    variants += (PALLAS,) if args.pallas else ()
    models = {}
    for policy in variants:
        model = kmp.convert(base, policy.split(":")[0])
        optimizer = make_optimizer()
        if policy == UNPACKED:
            optimizer = kmp.LeanOptimizer(optimizer, pack_small=False)
        if policy == PALLAS:
            optimizer = kmp.LeanOptimizer(optimizer)
            optimizer._kernel = "pallas"
        model.compile(
            optimizer=optimizer,
            loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        start = time.perf_counter()
        model.train_on_batch(x, y)
        first = time.perf_counter() - start
        for _ in range(args.warmup):
            model.train_on_batch(x, y)
        models[policy] = (model, first)
    times = {p: [] for p in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for policy in order + order[::-1]:  # ABBA (ABCCBA): each policy twice per round
            model = models[policy][0]
            block = []
            for _ in range(args.steps):
                start = time.perf_counter()
                model.train_on_batch(x, y)
                block.append(time.perf_counter() - start)
            times[policy].append(block)
    per_round = {p: [] for p in variants}
    for p in variants:
        for r in range(args.rounds):
            steps = times[p][2 * r] + times[p][2 * r + 1]
            per_round[p].append(statistics.median(steps))
    ratios = [lean / mixed for lean, mixed in zip(per_round[POLICIES[1]], per_round[POLICIES[0]])]
    lean_opt = models["lean_bfloat16"][0].optimizer
    extra = {}
    if args.unpacked:
        unpacked = [u / m for u, m in zip(per_round[UNPACKED], per_round[POLICIES[0]])]
        extra["unpacked_ratio_median"] = round(statistics.median(unpacked), 4)
        extra["unpacked_ratios"] = [round(r, 4) for r in unpacked]
    if args.pallas:
        pallas = [k / m for k, m in zip(per_round[PALLAS], per_round[POLICIES[0]])]
        extra["pallas_ratio_median"] = round(statistics.median(pallas), 4)
        extra["pallas_ratios"] = [round(r, 4) for r in pallas]
    return {
        "backend": keras.backend.backend(),
        "size": size,
        "parameters": int(base.count_params()),
        "variables": len(base.trainable_variables),
        "lean_optimizer": type(lean_opt).__name__,
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "ratios": [round(r, 4) for r in ratios],
        "step_ms_median": {p: round(1e3 * statistics.median(v), 3) for p, v in per_round.items()},
        # the fastest of all timed steps: on a machine whose load comes in bursts, the
        # figure least moved by them
        "step_ms_min": {p: round(1e3 * min(min(b) for b in v), 3) for p, v in times.items()},
        "first_step_s": {p: round(m[1], 2) for p, m in models.items()},
        "loss": {p: float(np.asarray(m[0].evaluate(x, y, verbose=0))) for p, m in models.items()},
        **extra,
    }


def worker(args) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for size in args.sizes.split(","):
        row = measure(size, args)
        print("ROW " + json.dumps(row), flush=True)
    return 0


def table(rows: list) -> str:
    unpacked = any("unpacked_ratio_median" in r for r in rows)
    pallas = any("pallas_ratio_median" in r for r in rows)
    lines = [
        "| backend | model | parameters | variables | lean / mixed step (median) | spread "
        "(min-max) | mixed step | lean step |"
        + (" pack_small=False / mixed |" if unpacked else "")
        + (" Pallas kernel / mixed |" if pallas else ""),
        "|---|---|---|---|---|---|---|---|"
        + ("---|" if unpacked else "")
        + ("---|" if pallas else ""),
    ]
    for r in rows:
        ms = r["step_ms_median"]
        name = r["size"] if r["size"] != "compare" else "compare transformer (Adam)"
        line = (
            f"| {r['backend']} | {name} | {r['parameters']:,} | {r['variables']} | "
            f"**{r['ratio_median']:.2f}** | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} | "
            f"{ms['mixed_bfloat16']:.1f} ms | {ms['lean_bfloat16']:.1f} ms |"
        )
        if unpacked:
            line += f" {r.get('unpacked_ratio_median', float('nan')):.2f} |"
        if pallas:
            line += f" {r.get('pallas_ratio_median', float('nan')):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="tensorflow,jax")
    p.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"of {list(ALL_SIZES)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="timed steps per policy per block")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument(
        "--unpacked",
        action="store_true",
        help="also time the lean step with pack_small=False (each state in its own arrays)",
    )
    p.add_argument(
        "--pallas",
        action="store_true",
        help="also time the lean step with the 4-bit update as one Pallas kernel a variable "
        "(keras_mp.lean.kernel; JAX; interpreted, so slow, without a GPU)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for size in args.sizes.split(","):
        if size not in ALL_SIZES:
            p.error(f"--sizes: unknown size {size!r}; choose from {list(ALL_SIZES)}")
    if args.worker:
        return worker(args)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = []
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *forwarded, "--worker"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            check=False,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("ROW "):
                rows.append(json.loads(line[4:]))
                print(line[4:], flush=True)
        if proc.returncode:
            print(f"{backend}: worker exited with {proc.returncode}", file=sys.stderr)
            return proc.returncode
    print(table(rows))
    if args.out:
        from importlib.metadata import version

        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "machine": (
                        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
                    ),
                    "keras": version("keras"),
                    "args": vars(args),
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
