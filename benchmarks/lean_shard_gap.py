"""Where lean's ModelParallel runs part from one device's (issue 46.2, the fingerprints).

    python benchmarks/lean_shard_gap.py        # JAX, 4 virtual CPU devices, about 2 min

tests/_lean_distribute_worker.py's model (LayerNorm-Dense-Dense-LayerNorm-Dense, width 64)
trains 8 steps of batch 16 with AdamW(1e-2) on one device and under ModelParallel 1 x 4
(the worker's layout map: kernels split on the model axis). Printed per variant: gap =
mean |w_4 - w_1| / mean |w_1 - w_init| (float32 values: lean's weights_float32), overall
and per variable. The variants separate the causes: the rounding noise (stochastic vs
kahan at float32 moments), the moments' blocks (a block never straddles two shards, so
4 shards group other elements under one scale than one device does, unless the block
length divides each shard's row segments: `block_size=16` here) and the moments' format.
"""

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.argv = ["x", "jax"]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import _lean_distribute_worker as w  # noqa: E402
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp as kmp  # noqa: E402

STEPS = 8
X = np.random.default_rng(0).normal(size=(w.BATCH * STEPS, w.WIDTH)).astype("float32")
Y = np.random.default_rng(1).normal(size=(w.BATCH * STEPS, w.WIDTH)).astype("float32")


def train(distribution, policy, **lean):
    keras.distribution.set_distribution(distribution)
    try:
        model = w.make_model(keras, kmp, policy)
        inner = keras.optimizers.AdamW(1e-2)
        opt = kmp.LeanOptimizer(inner, **lean) if policy == "lean_bfloat16" else inner
        model.compile(optimizer=opt, loss="mse")
        init = [np.asarray(v.value, "float32") for v in model.trainable_variables]
        model.fit(X, Y, batch_size=w.BATCH, shuffle=False, epochs=1, verbose=0)
        o = model.optimizer
        vals = (
            o.weights_float32()
            if policy == "lean_bfloat16"
            else [v.value for v in model.trainable_variables]
        )
        return init, [np.asarray(v, "float32") for v in vals]
    finally:
        keras.distribution.set_distribution(None)


devices = jax.devices()
mp = keras.distribution.ModelParallel(
    layout_map=w.layout_map(keras, devices, (1, 4)), batch_dim_name="batch"
)
variants = {
    "stochastic+int4 block16 (aligned)": ("lean_bfloat16", {"block_size": 16}),
    "stochastic+int8 block16 (aligned)": ("lean_bfloat16", {"moments": "int8", "block_size": 16}),
    "kahan+int4 block16 (aligned)": ("lean_bfloat16", {"rounding": "kahan", "block_size": 16}),
    "mixed_bfloat16": ("mixed_bfloat16", {}),
    "stochastic+int4 (default)": ("lean_bfloat16", {}),
    "stochastic+float32": ("lean_bfloat16", {"moments": "float32"}),
    "stochastic+int8": ("lean_bfloat16", {"moments": "int8"}),
    "kahan+int8": ("lean_bfloat16", {"rounding": "kahan", "moments": "int8"}),
    "kahan+float32": ("lean_bfloat16", {"rounding": "kahan", "moments": "float32"}),
}
for name, (policy, lean) in variants.items():
    init, one = train(None, policy, **lean)
    _, many = train(mp, policy, **lean)
    moved = np.mean([np.mean(np.abs(a - b)) for a, b in zip(one, init)])
    gap = np.mean([np.mean(np.abs(a - b)) for a, b in zip(many, one)])
    per = {
        v: round(float(np.mean(np.abs(a - b)) / max(np.mean(np.abs(b - i)), 1e-12)), 4)
        for v, a, b, i in zip(
            [
                "ln_in/g",
                "ln_in/b",
                "up/k",
                "up/b",
                "down/k",
                "down/b",
                "ln_out/g",
                "ln_out/b",
                "head/k",
                "head/b",
            ],
            many,
            one,
            init,
        )
    }
    print(
        json.dumps({"variant": name, "gap": round(float(gap / moved), 4), "per_var": per}),
        flush=True,
    )
