"""Compile-only memory and FLOP analysis of train steps (JAX backend, any device, no run).

XLA's buffer assignment is deterministic: it says how many bytes of temporaries a compiled
step needs, without allocating or running anything, so it can compare recipes at the GPU
sizes of issue 8 on a CPU. It prints one JSON line per configuration:

- `step`: the whole `model.train_step` (weights, optimizer slots and batch as abstract
  arguments, buffers donated as `model.fit` does) of a workload under a harness policy.
- `logits`: only the vocabulary projection plus the loss and their gradients, for the
  GPT workload: `stock` (bfloat16 Dense + Keras' loss, which up-casts the logits), `fp32_head`
  (the "usual advice": the projection in float32, then Keras' loss) and `keras_mp`
  (bfloat16 projection + `kmp.losses.SparseCategoricalCrossentropy`, fused).

Numbers are the compiling backend's: XLA:CPU materialises some tensors that XLA:GPU fuses
and schedules differently, so absolute bytes differ from a GPU's peak; differences between
recipes compiled by the same backend are what this measures.

    KERAS_BACKEND=jax python benchmarks/xla_memory.py --models gpt \
        --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16 --logits
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

GIB = 2**30


def _analysis(compiled) -> dict:
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {
        "temp_gib": round(memory.temp_size_in_bytes / GIB, 3),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "xla_flops": float((cost or {}).get("flops", 0.0)),
    }


def step_record(model_name: str, policy: str, keep_fp32=None) -> dict:
    """Compiles (does not run) one train step of `model_name` under a harness `policy`."""
    import jax
    import numpy as np

    from keras_mp.cli.measure import _compiled_model
    from keras_mp.cli.workloads import WORKLOADS

    workload = WORKLOADS[model_name]
    start = time.perf_counter()
    model = _compiled_model(workload, policy, True, keep_fp32)
    x, y = workload.data(np.random.default_rng(0))
    model._symbolic_build(data_batch=(x[:1], y[:1], None))
    model.optimizer.build(model.trainable_variables)
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    data = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype), None)
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(abstract, data).compile()
    return {
        "kind": "step",
        "model": model_name,
        "policy": policy,
        "keep_fp32": None if keep_fp32 is None else list(keep_fp32),
        **_analysis(compiled),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def logits_records(model_name: str = "gpt") -> list:
    """The vocabulary projection + loss + gradients of a GPT workload, three recipes."""
    import jax
    import jax.numpy as jnp
    import keras

    from keras_mp import losses
    from keras_mp.cli.workloads import WORKLOADS

    gpt = WORKLOADS[model_name]
    tokens, d, vocab = gpt.units_per_step, gpt.d_model, gpt.vocab
    stock_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours_loss = losses.SparseCategoricalCrossentropy(from_logits=True)

    def recipe(head_dtype, loss):
        def f(h, w, y):
            z = jnp.dot(h.astype(head_dtype), w.astype(head_dtype))
            return loss(y, z)

        return f

    recipes = {
        "stock": recipe(jnp.bfloat16, stock_loss),
        "fp32_head": recipe(jnp.float32, stock_loss),
        "keras_mp": recipe(jnp.bfloat16, ours_loss),
    }
    args = (
        jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((d, vocab), jnp.float32),
        jax.ShapeDtypeStruct((tokens,), jnp.int32),
    )
    records = []
    for name, f in recipes.items():
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        records.append(
            {
                "kind": "logits",
                "model": model_name,
                "recipe": name,
                "logits_shape": [tokens, vocab],
                **_analysis(grad.lower(*args).compile()),
            }
        )
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt")
    parser.add_argument(
        "--policies", default="float32,stock_mixed_bfloat16,keras_mp_mixed_bfloat16"
    )
    parser.add_argument("--keep-fp32", default=None, help="comma-separated keep-list override")
    parser.add_argument("--logits", action="store_true", help="also the logits-region records")
    parser.add_argument("--no-steps", action="store_true", help="only the logits records")
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    import jax
    import keras

    if keras.backend.backend() != "jax":
        print("xla_memory.py needs KERAS_BACKEND=jax", file=sys.stderr)
        return 2
    keep = None if args.keep_fp32 is None else tuple(args.keep_fp32.split(","))
    records = []
    for model_name in args.models.split(","):
        if args.logits and model_name.endswith("gpt"):
            records += logits_records(model_name)
        if not args.no_steps:
            records += [step_record(model_name, p, keep) for p in args.policies.split(",")]
    device = str(jax.devices()[0].device_kind)
    for record in records:
        record.update(device=device, jax=jax.__version__, keras=keras.__version__)
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
