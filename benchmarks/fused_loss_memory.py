"""Compile-only memory of a language model's loss and its gradient: plain vs fused.

The loss of `hidden @ kernel` (hidden states `tokens x H`, kernel `H x vocabulary`, both
bfloat16) against integer labels, and its gradient with respect to both, compiled (not
run) two ways:

- stock: the logits made whole (bfloat16) and Keras'
  `SparseCategoricalCrossentropy(from_logits=True)` (a float32 copy of the logits);
- plain: the logits made whole (bfloat16, as a keras_hub head makes them) and
  `kmp.losses.SparseCategoricalCrossentropy(from_logits=True)`'s fused softmax loss on
  them (float32 log-sum-exp, the gradient written in the logits' dtype);
- fused: `keras_mp.numerics.linear_cross_entropy` (issue 54, lever 3): vocabulary
  chunks of at most 256 MiB of float32 logits, recomputed in the backward pass.

For each (tokens, vocabulary) it prints XLA's `memory_analysis()`: the temporaries and
the peak (arguments + outputs + temporaries; the arguments and the two gradients are the
same for both, so the difference is the loss's own). As Liger Kernel's table, for
JAX.

    PYTHONPATH=. python benchmarks/fused_loss_memory.py                     # this CPU
    PYTHONPATH=. /work/venv-h200/bin/python benchmarks/fused_loss_memory.py --target h200
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GIB = 2**30


def record(tokens: int, vocabulary: int, hidden: int, kind: str, device) -> dict:
    import jax
    import jax.numpy as jnp
    from keras import ops

    import keras_mp as kmp
    from keras_mp.numerics.linear_cross_entropy import chunk_for, linear_cross_entropy

    sharding = jax.sharding.SingleDeviceSharding(device)
    h = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((hidden, vocabulary), jnp.bfloat16, sharding=sharding)
    y = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding)
    import keras

    fused = kind == "fused"
    if kind == "stock":
        plain_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        plain_loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(h, w, y):
        if fused:
            per, _ = linear_cross_entropy(h, w, y)
            return ops.mean(per)
        return plain_loss(y, ops.matmul(h, w))

    start = time.perf_counter()
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    compiled = step.lower(h, w, y).compile()
    stats = compiled.memory_analysis()
    arguments = stats.argument_size_in_bytes
    outputs = stats.output_size_in_bytes
    temp = stats.temp_size_in_bytes
    return {
        "kind": "fused_loss_memory",
        "loss": kind,
        "tokens": tokens,
        "vocabulary": vocabulary,
        "hidden": hidden,
        "chunk": chunk_for(tokens, vocabulary) if fused else None,
        "logits_bf16_gib": round(tokens * vocabulary * 2 / GIB, 3),
        "arguments_gib": round(arguments / GIB, 3),
        "outputs_gib": round(outputs / GIB, 3),
        "temp_gib": round(temp / GIB, 3),
        "peak_gib": round((arguments + outputs + temp) / GIB, 3),
        "device": str(device.device_kind),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192,32768")
    parser.add_argument("--vocabulary", default="32000,128256,256000")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--target", default=None, help="h200 or a .txtpb (XLA:GPU, compile only)")
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    if args.target:
        os.environ["JAX_PLATFORMS"] = "cpu"
    from gemma_memory import devices_for

    from keras_mp.cli.records import emit

    device = devices_for(args.target, 1)[0]
    for tokens in map(int, args.tokens.split(",")):
        for vocabulary in map(int, args.vocabulary.split(",")):
            for kind in ("stock", "plain", "fused"):
                emit(record(tokens, vocabulary, args.hidden, kind, device), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
