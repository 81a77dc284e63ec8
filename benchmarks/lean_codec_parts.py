"""The lean update's parts timed one by one on JAX: which part of the 4-bit moments costs.

    KERAS_BACKEND=jax python benchmarks/lean_codec_parts.py              # a GPU: 64M values
    KERAS_BACKEND=jax python benchmarks/lean_codec_parts.py --values 1M  # a CPU

Section 16.4 of BENCHMARKS.md measured the default state's update (stochastic + int4) at
6.9x float32 AdamW's on an H200, the int8 one at 2.0x and the bfloat16 one at 0.6x. This
script times each piece of `keras_mp.lean` on one flat variable of `--values` values, each
its own `jax.jit` (inputs made once, outputs blocked on), median of `--repeats` calls:

- `adamw_float32`: Keras' AdamW formula on float32 weight and moments (the reference);
- `rule_<fmt>`: one whole `lean_rule` (AdamW, stochastic rounding), moments in `<fmt>`;
- `hash`: the three uniforms of a step (`codecs.uniforms`);
- `decode_<fmt>_<m|v>` / `encode_<fmt>_<m|v>`: one moment's decode / encode;
- `int4_code_<m|v>`, `int4_pack`, `block_max`: the 4-bit encode's stages on their own;
- `rule_int4_two_step`, `encode_int4_<m|v>_two_step`, `block_max_two_step`: the same with
  the blocks' maxima taken in two steps (`two_step_block_max`: an element-wise maximum over
  groups of 8, then rows 8 times shorter). Compiled for an H200, that removes the short-row
  reduction strategy XLA takes for rows of 128 (64-94 registers and a stack frame a
  thread); on a 2-core CPU it made the int4 rule 2.5x slower. Its outputs are checked to be
  the one-step ones, bit for bit, before anything is timed.

Prints one JSON line: milliseconds per call and GB/s of the bytes each must move.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _count(text: str) -> int:
    scale = {"K": 10**3, "M": 2**20, "G": 2**30}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if text[-1].isalpha() else text) * scale)


def two_step_block_max(values):
    """`codecs._block_max` in two steps: the maximum over groups of 8 values of each row
    as element-wise maxima, then over rows 8 times shorter (rows of at most 256 values
    that are a multiple of 8; others in one step). The same values: a maximum is exact."""
    from keras import ops

    count, length = values.shape
    if length > 256 or length % 8:
        return ops.max(values, axis=1)
    groups = ops.reshape(values, (count, length // 8, 8))
    partial = groups[:, :, 0]
    for i in range(1, 8):
        partial = ops.maximum(partial, groups[:, :, i])
    return ops.max(partial, axis=1)


def _two_step(fn):
    """`fn` traced with `codecs._block_max` replaced by `two_step_block_max`."""
    from keras_mp.lean import codecs

    def wrapped(*args):
        one_step = codecs._block_max
        codecs._block_max = two_step_block_max
        try:
            return fn(*args)
        finally:
            codecs._block_max = one_step

    return wrapped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--values", default="64M", help="values of the variable (e.g. 1M, 64M)")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "jax")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from keras_mp.lean import codecs, int4, rule

    n = _count(args.values)
    width = 1024
    shape = (n // width, width)
    n = shape[0] * width
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 1e-3, dtype=jnp.bfloat16)
    w32 = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)
    m32 = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 1e-4)
    v32 = jnp.abs(m32) * 1e-2 + 1e-8
    hyper = rule.Hyper("adamw", "stochastic", 0.9, 0.999, 1e-7, 0.0, False)
    noise = codecs.uniforms(shape, 7, 3)

    parts = {}

    def adamw(w, g, m, v):
        g = g.astype(jnp.float32)
        m = m + (g - m) * 0.1
        v = v + (g * g - v) * 0.001
        w = w - 1e-3 * 0.01 * w - 1e-3 * m / (jnp.sqrt(v) + 1e-7)
        return w, m, v

    parts["adamw_float32"] = (adamw, (w32, g, m32, v32), 2 + 3 * 8)

    def state(fmt):
        blocks = codecs.blocks_for(shape, 128 if fmt == "int4" else 2048)
        m, m_scale = codecs.encode_moment(m32, fmt, True, noise[1], blocks)
        v, v_scale = codecs.encode_moment(v32, fmt, False, noise[2], blocks)
        return blocks, {"m": m, "m_scale": m_scale, "v": v, "v_scale": v_scale}

    for fmt, nbytes in (("int4", 0.5), ("int8", 1.0), ("bfloat16", 2.0)):
        blocks, moments = state(fmt)
        static = rule.Static(shape, "bfloat16", fmt, fmt, blocks)
        values = {
            "weight": w32.astype(jnp.bfloat16),
            "grad": g,
            "lr": jnp.float32(1e-3),
            "iterations": jnp.int32(3),
            "seed": jnp.int32(11),
            "weight_decay": jnp.float32(0.01),
            **{k: x for k, x in moments.items() if x is not None},
        }

        def whole(values, static=static):
            return rule.lean_rule(static, hyper, values)

        parts[f"rule_{fmt}"] = (whole, (values,), 2 + 2 * 2 + 2 * 2 * nbytes)
        for name, signed in (("m", True), ("v", False)):
            codes, scale = moments[name], moments[name + "_scale"]

            def decode(codes, scale, fmt=fmt, signed=signed, blocks=blocks):
                return codecs.decode_moment(codes, scale, fmt, signed, shape, blocks)

            def encode(x, u, fmt=fmt, signed=signed, blocks=blocks):
                return codecs.encode_moment(x, fmt, signed, u, blocks)

            x = m32 if signed else v32
            parts[f"decode_{fmt}_{name}"] = (decode, (codes, scale), nbytes + 4)
            parts[f"encode_{fmt}_{name}"] = (encode, (x, noise[1]), 8 + nbytes)

    blocks = codecs.blocks_for(shape, 128)
    rows = (blocks.count, blocks.length)
    m_blocks, u_blocks = jnp.reshape(m32, rows), jnp.reshape(noise[1], rows)
    v_blocks = jnp.reshape(v32, rows)

    def block_max(x):
        return jnp.max(jnp.abs(x), axis=1)

    def code(x, u, signed):
        scale = jnp.max(jnp.abs(x), axis=1, keepdims=True)
        return int4.code(x, jnp.abs(x) / scale, u, signed)

    parts["block_max"] = (block_max, (m_blocks,), 4)
    parts["block_max_two_step"] = (lambda x: two_step_block_max(jnp.abs(x)), (m_blocks,), 4)
    for name in ("rule_int4", "encode_int4_m", "encode_int4_v"):
        fn, inputs, nbytes = parts[name]
        parts[name + "_two_step"] = (_two_step(fn), inputs, nbytes)
        same = jax.tree.map(
            lambda a, b: bool(jnp.array_equal(a, b, equal_nan=True)),
            jax.jit(fn)(*inputs),
            jax.jit(_two_step(fn))(*inputs),
        )
        if not all(jax.tree.leaves(same)):
            raise SystemExit(f"{name}: the two-step block maxima changed the outputs: {same}")
    parts["int4_code_m"] = (lambda x, u: code(x, u, True), (m_blocks, u_blocks), 12)
    parts["int4_code_v"] = (lambda x, u: code(x, u, False), (v_blocks, u_blocks), 12)
    codes = jnp.floor(u_blocks * 16.0)
    parts["int4_pack"] = (int4.pack, (codes,), 4.5)
    parts["hash"] = (lambda: codecs.uniforms(shape, 7, 3), (), 12)

    out = {"device": str(jax.devices()[0]), "values": n, "ms": {}, "gb_per_s": {}}
    for name, (fn, inputs, bytes_per_value) in parts.items():
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*inputs))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(jitted(*inputs))
            times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        out["ms"][name] = round(ms, 4)
        out["gb_per_s"][name] = round(bytes_per_value * n / ms / 1e6, 1)
        print(f"# {name}: {ms:.3f} ms", file=sys.stderr, flush=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
