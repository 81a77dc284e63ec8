"""The lean update inside the backward pass against the ordinary lean step (JAX, this host).

Issue 54's lever 1 (`kmp.LeanOptimizer(opt, update_in_backward=True)`,
`keras_mp.lean.in_backward`), side by side in one process on a keras_hub Llama-3 of
small explicit shapes (no preset, no download), lean_bfloat16, AdamW:

- `--memory`: compiles both train steps (as Keras' `fit` does: `jax.jit`, the state
  donated) and prints XLA's `memory_analysis()` (arguments, outputs, temporaries, peak)
  for each: what the weight gradients held until the update cost, and what is left;
- `--speed`: times both steps on real data (medians of `--repeats` rounds of `--steps`
  steps each, the two alternating so that the machine's load hits both alike).

    PYTHONPATH=. KERAS_BACKEND=jax python benchmarks/in_backward.py --memory --speed

The 8B figures are `gemma_memory.py`'s `lean@fused+chunked+backward` (BENCHMARKS 23).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")

GIB = 2**30


def build(update_in_backward: bool, args):
    import keras
    import keras_hub

    import keras_mp as kmp

    # keras_hub's softmax layers are made float32: convert runs them in bfloat16 (it says so)
    warnings.filterwarnings("ignore", message=r"Layer\(s\) .*attention_softmax")

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=args.vocabulary,
        num_layers=args.layers,
        num_query_heads=8,
        num_key_value_heads=2,
        hidden_dim=args.hidden,
        intermediate_dim=args.hidden * 3,
    )
    task = keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)
    task = kmp.convert(task, "lean_bfloat16")
    opt = kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-4, weight_decay=0.01, global_clipnorm=args.clipnorm),
        update_in_backward=update_in_backward,
    )
    task.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    return task


def data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocabulary, (args.batch, args.sequence + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones_like(tokens[:, :-1])}
    return x, tokens[:, 1:]


def memory(model, batch, device) -> dict:
    import jax
    from xla_memory import _analysis

    model.optimizer.build(model.trainable_variables)
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(variables):
        return [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=sharding) for v in variables]

    state = (
        spec(model.trainable_variables),
        spec(model.non_trainable_variables),
        spec(model.optimizer.variables),
        spec(model.metrics_variables),
    )
    x, y = batch

    def data_spec(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    data = (jax.tree.map(data_spec, x), data_spec(y), None)
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile()
    found = _analysis(compiled)
    import numpy as np

    grads = sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)
    return {
        "arguments_gib": round(found["argument_bytes"] / GIB, 4),
        "temporaries_gib": round(found["temp_bytes"] / GIB, 4),
        "peak_gib": round(found["peak_estimate_gib"], 4),
        "weight_gradients_gib": round(grads / GIB, 4),
        "dot_flops": found["dot_flops"],
    }


def speed(models, batch, args) -> dict:
    import numpy as np

    x, y = batch
    times = {name: [] for name in models}
    for model in models.values():  # compile and warm up
        model.fit(x, y, batch_size=args.batch, epochs=1, steps_per_epoch=1, verbose=0)
    for _ in range(args.repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model.fit(
                {k: np.tile(v, (args.steps, 1)) for k, v in x.items()},
                np.tile(y, (args.steps, 1)),
                batch_size=args.batch,
                epochs=1,
                verbose=0,
            )
            times[name].append((time.perf_counter() - start) / args.steps)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--target", default=None, help="--memory: h200 (XLA:GPU, compile only)")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--vocabulary", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--clipnorm", type=float, default=1.0, help="global_clipnorm")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.target:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the host runs Keras; XLA:GPU only compiles
    import jax
    import keras

    if keras.backend.backend() != "jax":
        print("in_backward.py needs KERAS_BACKEND=jax", file=sys.stderr)
        return 2
    batch = data(args)
    models = {"lean": build(False, args), "lean_in_backward": build(True, args)}
    params = sum(math.prod(v.shape) for v in models["lean"].trainable_variables)
    record = {
        "kind": "lean_in_backward",
        "model": f"Llama3CausalLM(vocabulary={args.vocabulary}, layers={args.layers}, "
        f"hidden={args.hidden})",
        "parameters": int(params),
        "batch": args.batch,
        "sequence": args.sequence,
        "global_clipnorm": args.clipnorm,
        "device": str(jax.devices()[0].device_kind),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
    }
    if args.memory:
        from gemma_memory import devices_for

        device = devices_for(args.target, 1)[0]
        record["memory_device"] = str(device.device_kind)
        record["memory"] = {name: memory(m, batch, device) for name, m in models.items()}
    if args.speed:
        seconds = speed(models, batch, args)
        record["step_s"] = seconds
        record["in_backward_over_lean"] = seconds["lean_in_backward"] / seconds["lean"]
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
