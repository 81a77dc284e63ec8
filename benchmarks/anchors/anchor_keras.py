# ruff: noqa  (verbatim copy of the reference anchor; see README.md)
"""Anchor benchmark: stock Keras 3 mixed precision under XLA, one config per process.

Measures what a user gets today with keras.mixed_precision alone, so that the
project's own figures can be set against it on the same machine in the same run.
  python anchor_keras.py --one gpt mixed_bfloat16      # one config -> JSON line
  python anchor_keras.py --all --out results.jsonl     # every config, each in a subprocess
"""
import argparse, json, os, subprocess, sys, time

MODELS = {
    # name: (builder, batch, flops_per_step_estimate_fn)
    "gpt": dict(batch=16, seq=1024, d=1024, heads=16, layers=8, ff=4096, vocab=32768),
    "resnet50": dict(batch=256, size=224, classes=1000),
    "cpu_gpt": dict(batch=8, seq=256, d=256, heads=4, layers=4, ff=1024, vocab=8192),
    "cpu_resnet": dict(batch=32, size=64, classes=100),
    "tiny_gpt": dict(batch=2, seq=64, d=64, heads=4, layers=2, ff=128, vocab=512),
    "tiny_resnet": dict(batch=4, size=32, classes=10),
}
POLICIES = ["float32", "float32_highest", "mixed_bfloat16", "mixed_float16"]


def build(name, keras):
    cfg = MODELS[name]
    L = keras.layers
    if "gpt" in name:
        inp = keras.Input((cfg["seq"],), dtype="int32")
        x = L.Embedding(cfg["vocab"], cfg["d"])(inp)
        for _ in range(cfg["layers"]):
            h = L.LayerNormalization()(x)
            h = L.MultiHeadAttention(cfg["heads"], cfg["d"] // cfg["heads"])(h, h, use_causal_mask=True)
            x = x + h
            h = L.LayerNormalization()(x)
            h = L.Dense(cfg["ff"], activation="gelu")(h)
            x = x + L.Dense(cfg["d"])(h)
        x = L.LayerNormalization()(x)
        out = L.Dense(cfg["vocab"])(x)
        model = keras.Model(inp, out)
        n = cfg["layers"] * 12 * cfg["d"] ** 2 + cfg["vocab"] * cfg["d"]
        tokens = cfg["batch"] * cfg["seq"]
        flops = 6 * n * tokens + cfg["layers"] * 12 * cfg["seq"] * cfg["d"] * tokens
        x_data = lambda rng: rng.integers(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), dtype="int32")
        y_data = x_data
        return model, flops, x_data, y_data, tokens
    model = keras.applications.ResNet50(weights=None, input_shape=(cfg["size"], cfg["size"], 3), classes=cfg["classes"],
                                        classifier_activation=None)
    flops = 3 * 2 * 4.1e9 * cfg["batch"] * (cfg["size"] / 224) ** 2
    x_data = lambda rng: rng.standard_normal((cfg["batch"], cfg["size"], cfg["size"], 3), dtype="float32")
    y_data = lambda rng: rng.integers(0, cfg["classes"], (cfg["batch"],), dtype="int32")
    return model, flops, x_data, y_data, cfg["batch"]


def one(name, policy, steps, warmup):
    if os.environ.get("KERAS_BACKEND", "jax") == "jax":
        import jax
        if policy == "float32_highest":
            jax.config.update("jax_default_matmul_precision", "highest")
    import keras
    import numpy as np
    keras.mixed_precision.set_global_policy("float32" if policy.startswith("float32") else policy)
    model, flops, xf, yf, units = build(name, keras)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=os.environ.get("JIT", "1") == "1")
    rng = np.random.default_rng(0)
    x, y = xf(rng), yf(rng)
    t0 = time.perf_counter()
    model.train_on_batch(x, y)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        model.train_on_batch(x, y)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        loss = model.train_on_batch(x, y)
        times.append(time.perf_counter() - t)  # train_on_batch returns a host float: synchronous
    times.sort()
    med = times[len(times) // 2]
    try:
        dev = jax.devices()[0]
        stats = dev.memory_stats()
    except Exception:
        dev, stats = keras.backend.backend(), None
    return dict(model=name, policy=policy, backend=keras.backend.backend(), device=str(getattr(dev, "device_kind", dev)),
                compile_s=round(compile_s, 2), step_ms_median=round(med * 1e3, 3), step_ms_min=round(times[0] * 1e3, 3),
                units_per_s=round(units / med, 1), tflops=round(flops / med / 1e12, 1),
                peak_mem_gib=round(stats["peak_bytes_in_use"] / 2**30, 2) if stats else None,
                loss=float(loss if not isinstance(loss, list) else loss[0]),
                optimizer=type(model.optimizer).__name__, keras=keras.__version__)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--models", default="gpt,resnet50")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=int, default=150)
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one[0], a.one[1], a.steps, a.warmup)), flush=True)
        sys.exit(0)
    for m in a.models.split(","):
        for p in a.policies.split(","):
            cmd = [sys.executable, __file__, "--one", m, p, "--steps", str(a.steps), "--warmup", str(a.warmup)]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
                lines = [l[7:] for l in r.stdout.splitlines() if l.startswith("RESULT ")]
                rec = json.loads(lines[0]) if lines else dict(model=m, policy=p, error=r.stderr[-800:])
            except subprocess.TimeoutExpired:
                rec = dict(model=m, policy=p, error="timeout")
            print(json.dumps(rec), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
