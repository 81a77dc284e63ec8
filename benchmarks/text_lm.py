"""Byte-level language model on real text: float32 vs mixed / lean / pure bfloat16.

The text is the Python standard library's own source, read from the running interpreter's
installation (every machine has it; nothing is downloaded). The model is keras_hub's
`GPT2Backbone` built from small explicit sizes, with tied output embeddings. Every policy
starts from the same float32 weights and sees the same batches; the table gives the final
validation loss (nats per byte) against float32's, the persistent training state in bytes
per parameter (`kmp.state_bytes`) and the step time relative to float32 (one process, side
by side: ratios only).

    KERAS_BACKEND=tensorflow python benchmarks/text_lm.py --steps 1500 \\
        --out benchmarks/results/text_lm.json

`--steps 20 --layers 1` is a smoke run. `--policies` also takes lean variants written
`lean_bfloat16:ROUNDING:MOMENTS` (e.g. `lean_bfloat16:stochastic:bfloat16`): the model
converted to `lean_bfloat16` and compiled with `kmp.LeanOptimizer(AdamW(...), rounding=...,
moments=...)`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
import time
import warnings

import numpy as np

POLICIES = ("float32", "mixed_bfloat16", "lean_bfloat16", "bfloat16")


def stdlib_text(max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's .py files (sorted by path), up to `max_bytes`."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8).astype("int32")


def windows(text: np.ndarray, count: int, length: int, rng) -> tuple:
    starts = rng.integers(0, len(text) - length - 1, size=count)
    idx = starts[:, None] + np.arange(length + 1)[None, :]
    seq = text[idx]
    return seq[:, :-1], seq[:, 1:]


def build_model(args):
    import keras
    import keras_hub

    keras.utils.set_random_seed(args.seed)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256,
        num_layers=args.layers,
        num_heads=args.heads,
        hidden_dim=args.width,
        intermediate_dim=4 * args.width,
        max_sequence_length=args.length,
        dropout=0.0,
    )
    tokens = keras.Input((args.length,), dtype="int32", name="token_ids")
    mask = keras.ops.ones_like(tokens)
    hidden = backbone({"token_ids": tokens, "padding_mask": mask})
    logits = backbone.token_embedding(hidden, reverse=True)
    return keras.Model(tokens, logits, name="byte_gpt")


def run_policy(policy: str, base, data: dict, args) -> dict:
    import keras

    import keras_mp as kmp

    name, *variant = policy.split(":")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # pure bfloat16 warns: on purpose
        if name == "bfloat16":
            model = kmp.convert(base, kmp.Policy("bfloat16", keep_fp32=()))
        else:
            model = kmp.convert(base, name)
    schedule = keras.optimizers.schedules.CosineDecay(
        0.0, args.steps, alpha=0.1, warmup_target=args.lr, warmup_steps=args.steps // 20
    )
    optimizer = keras.optimizers.AdamW(schedule, weight_decay=0.01, global_clipnorm=1.0)
    if variant:
        rounding, moments = variant
        optimizer = kmp.LeanOptimizer(optimizer, rounding=rounding, moments=moments)
    model.compile(
        optimizer=optimizer,
        loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    x, y = data["train"]
    vx, vy = data["val"]
    bs = args.batch_size
    losses, times = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = model.train_on_batch(x[step * bs : (step + 1) * bs], y[step * bs : (step + 1) * bs])
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if args.log_every and (step + 1) % args.log_every == 0:
            print(
                json.dumps(
                    {
                        "policy": policy,
                        "step": step + 1,
                        "train_loss": float(np.mean(losses[-args.log_every :])),
                    }
                ),
                flush=True,
            )
    val = float(model.evaluate(vx, vy, batch_size=64, verbose=0))
    state = kmp.state_bytes(model)
    return {
        "policy": policy,
        "optimizer": type(model.optimizer).__name__,
        "val_loss": val,
        "final_train_loss": float(np.mean(losses[-50:])),
        "state_bytes_per_parameter": round(state.per_parameter, 3),
        "state": state.to_dict(),
        "step_seconds_median": float(np.median(times[len(times) // 5 :])),
    }


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["policy"] == "float32"), None)
    lines = [
        "| policy | optimizer | val loss (nats/byte) | vs float32 | state B/param "
        "| step time vs float32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = f"{100 * (r['val_loss'] / ref['val_loss'] - 1):+.2f}%" if ref else "n/a"
        speed = f"{r['step_seconds_median'] / ref['step_seconds_median']:.2f}x" if ref else "n/a"
        lines.append(
            f"| {r['policy']} | {r['optimizer']} | {r['val_loss']:.4f} | {rel} | "
            f"{r['state_bytes_per_parameter']:.2f} | {speed} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--text-bytes", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", default=None)
    p.add_argument(
        "--log-every",
        type=int,
        default=0,
        help="print the mean training loss every N steps (0: only the final rows)",
    )
    args = p.parse_args(argv)

    import keras

    text = stdlib_text(args.text_bytes)
    split = int(0.9 * len(text))
    rng = np.random.default_rng(args.seed)
    data = {
        "train": windows(text[:split], args.steps * args.batch_size, args.length, rng),
        "val": windows(text[split:], 512, args.length, rng),
    }
    base = build_model(args)
    rows = []
    for policy in args.policies.split(","):
        rows.append(run_policy(policy, base, data, args))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "state"}), flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "backend": keras.backend.backend(),
        "keras": keras.__version__,
        "text_bytes": int(len(text)),
        "parameters": int(base.count_params()),
        "args": vars(args),
        "rows": rows,
    }
    print(table(rows))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
