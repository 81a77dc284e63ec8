"""The 4-bit lean update as one Pallas kernel against XLA's `lean_rule`: agreement and time.

    KERAS_BACKEND=jax python benchmarks/lean_kernel_check.py                 # a GPU: 64M values
    KERAS_BACKEND=jax python benchmarks/lean_kernel_check.py --values 256K --reps 3   # a CPU

One bfloat16 variable of `--values` values (rows of 1024) with AdamW's 4-bit state
(`rounding="stochastic"`, `moments="int4"`, the default) and a bfloat16 gradient. Each
variant is one jitted update:

- `xla`: `keras_mp.lean.rule.lean_rule`, as the train step traces it today;
- `pallas RxW`: `keras_mp.lean.kernel.lean_kernel_rule` with R blocks of 128 values a
  program and W warps (`--configs`); on a CPU Pallas' interpreter runs it (for a dry run);
- `adamw32`: float32 AdamW on float32 weight and moments (12 bytes a parameter), the same
  arithmetic in plain `jax.numpy`: what `mixed_bfloat16`'s update moves.

Agreement (before timing): one update from the same state, each kernel against `xla`:
the share of weights, first- and second-moment codes whose bits differ (0 under the
interpreter; compiled by Triton, square roots and divisions may round apart), and after
`--chain` updates from the same gradients the largest difference of the decoded weights
relative to how far the weights moved. Time: rounds of `--reps` calls of each variant in
alternating order, each call waited for; the median, and the bytes each must move (read
and written, its own format) over that time. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

UNITS = {"K": 2**10, "M": 2**20}


def parse_values(text: str) -> int:
    text = text.strip().upper()
    if text[-1:] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", default="64M")
    p.add_argument("--configs", default="4x4,8x4,16x4,8x8,32x8", help="rows x warps")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--chain", type=int, default=20)
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_mp.lean import codecs
    from keras_mp.lean import kernel as lean_kernel
    from keras_mp.lean.rule import Hyper, Static, lean_rule

    values_count = parse_values(args.values)
    shape = (max(1, values_count // 1024), 1024)
    n = shape[0] * shape[1]
    blocks = codecs.blocks_for(shape, 128)
    static = Static(shape, "bfloat16", "int4", "int4", blocks)
    hyper = Hyper("adamw", "stochastic", 0.9, 0.999, 1e-7, 0.0, False)
    interpret = jax.default_backend() != "gpu"
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    m = jax.random.normal(k1, shape, "float32") * 1e-3
    v = jnp.square(jax.random.normal(k2, shape, "float32") * 1e-3)
    m_codes, m_scale = codecs.encode_moment(m, "int4", True, None, blocks)
    v_codes, v_scale = codecs.encode_moment(v, "int4", False, None, blocks)
    state = {
        "weight": jax.random.normal(k3, shape, "float32").astype("bfloat16"),
        "m": m_codes,
        "m_scale": m_scale,
        "v": v_codes,
        "v_scale": v_scale,
    }
    scalars = {
        "lr": jnp.float32(1e-3),
        "seed": jnp.int32(7919),
        "weight_decay": jnp.float32(0.01),
    }

    def grad_at(step):
        return (jax.random.normal(jax.random.fold_in(key, step), shape, "float32") * 1e-2).astype(
            "bfloat16"
        )

    def xla(state, grad, step):
        return lean_rule(static, hyper, {**state, **scalars, "grad": grad, "iterations": step})

    def kernel(rows, warps):
        def run(state, grad, step):
            values = {**state, **scalars, "grad": grad, "iterations": step}
            return lean_kernel.lean_kernel_rule(
                static, hyper, values, interpret=interpret, rows=rows, warps=warps
            )

        return run

    variants = {"xla": jax.jit(xla)}
    for config in args.configs.split(","):
        rows, warps = (int(x) for x in config.split("x"))
        if blocks.count % rows == 0:
            variants[f"pallas {rows}x{warps}"] = jax.jit(kernel(rows, warps))

    w32 = state["weight"].astype("float32")
    adam_state = (w32, jnp.zeros(shape, "float32"), jnp.zeros(shape, "float32"))

    @jax.jit
    def adamw32(s, grad, step):
        w, m_, v_ = s
        g = grad.astype("float32")
        t = (step + 1).astype("float32")
        m_ = m_ + (g - m_) * 0.1
        v_ = v_ + (g * g - v_) * 0.001
        alpha = 1e-3 * jnp.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        w = w - w * 1e-5 - alpha * m_ / (jnp.sqrt(v_) + 1e-7)
        return w, m_, v_

    def bits(x):
        return np.atleast_1d(np.asarray(x)).view(np.uint8)

    grad0 = grad_at(0)
    step0 = jnp.int32(10)
    reference = jax.block_until_ready(variants["xla"](state, grad0, step0))
    agreement = {}
    for name, fn in variants.items():
        if name == "xla":
            continue
        out = jax.block_until_ready(fn(state, grad0, step0))
        row = {}
        for part in ("weight", "m", "v", "m_scale", "v_scale"):
            row[part] = float(np.mean(bits(out[part]) != bits(reference[part])))
        agreement[name] = row
    # a chain of updates from the same gradients: how far apart the weights drift
    chain = {}
    start_w = np.asarray(state["weight"].astype("float32"))
    for name in ["xla", next((k for k in variants if k != "xla"), None)]:
        if name is None:
            continue
        s = dict(state)
        for step in range(args.chain):
            s = {**s, **variants[name](s, grad_at(step), jnp.int32(step))}
        chain[name] = s
    if len(chain) == 2:
        (a_name, a), (b_name, b) = chain.items()
        wa = np.asarray(a["weight"].astype("float32"))
        wb = np.asarray(b["weight"].astype("float32"))
        moved = float(np.sqrt(np.mean(np.square(wa - start_w))))
        apart = float(np.sqrt(np.mean(np.square(wa - wb))))
        chain_row = {
            "steps": args.chain,
            "rms_moved_xla": moved,
            "rms_apart": apart,
            "apart_over_moved": round(apart / moved, 4) if moved else None,
        }
    else:
        chain_row = None

    # bytes each must read and write (its own formats; the gradient is bfloat16)
    blocks_bytes = 2 * blocks.count * 4 * 2  # two moments' scales, read and written
    lean_bytes = n * (2 + 2 + 0.5 + 0.5) + n * (2 + 0.5 + 0.5) + blocks_bytes
    sizes = {name: lean_bytes for name in variants}
    sizes["adamw32"] = n * (4 + 2 + 4 + 4) + n * (4 + 4 + 4)
    calls = {**variants, "adamw32": adamw32}
    inputs = {name: state for name in variants}
    inputs["adamw32"] = adam_state
    for name, fn in calls.items():  # compiled and warm
        jax.block_until_ready(fn(inputs[name], grad0, step0))
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = calls[name]
            for _ in range(args.reps):
                start = time.perf_counter()
                jax.block_until_ready(fn(inputs[name], grad0, step0))
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    row = {
        "device": str(jax.devices()[0]),
        "interpret": interpret,
        "values": n,
        "ms_median": {k: round(1e3 * v, 4) for k, v in median.items()},
        "ms_min": {k: round(1e3 * min(t), 4) for k, t in times.items()},
        "gb_per_s": {k: round(sizes[k] / v / 1e9, 1) for k, v in median.items()},
        "vs_xla": {k: round(v / median["xla"], 3) for k, v in median.items()},
        "vs_adamw32": {k: round(v / median["adamw32"], 3) for k, v in median.items()},
        "bits_differ_vs_xla": agreement,
        "chain": chain_row,
    }
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
