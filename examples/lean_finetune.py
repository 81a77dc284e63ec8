"""Fine-tune a language model with half the training state: `lean_bfloat16`.

A keras_hub GPT-2 causal LM (built from small explicit sizes, no download) is trained on the
Python standard library's own source, byte by byte, twice from the same weights: under
`mixed_bfloat16` (float32 master weights and Adam moments: 12 bytes a parameter) and under
`lean_bfloat16` (bfloat16 weights rounded stochastically and 4-bit moments: about 3).
Same batches, same schedule; it prints the state and the loss of each.

    python examples/lean_finetune.py          # a few minutes on a laptop CPU
    KERAS_MP_EXAMPLE_FAST=1 python examples/lean_finetune.py
"""

import glob
import os
import sysconfig

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_mp as kmp  # noqa: E402

FAST = os.environ.get("KERAS_MP_EXAMPLE_FAST") == "1"
STEPS, BATCH, LENGTH = (30, 8, 32) if FAST else (600, 16, 128)


def text(max_bytes=2_000_000) -> np.ndarray:
    """The standard library's .py files as bytes (every Python installation has them)."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = b"".join(open(p, "rb").read() for p in paths[:200])[:max_bytes]
    return np.frombuffer(data, dtype=np.uint8).astype("int32")


def batches(tokens, rng):
    starts = rng.integers(0, len(tokens) - LENGTH - 1, size=(STEPS, BATCH))
    windows = tokens[starts[..., None] + np.arange(LENGTH + 1)]
    return windows[..., :-1], windows[..., 1:]


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=256, num_layers=2, num_heads=4, hidden_dim=128,
        intermediate_dim=512, max_sequence_length=LENGTH, dropout=0.0,
    )
    tokens = keras.Input((LENGTH,), dtype="int32")
    hidden = backbone({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
    return keras.Model(tokens, backbone.token_embedding(hidden, reverse=True))


def main():
    x, y = batches(text(), np.random.default_rng(0))
    base = build()
    for policy in ("mixed_bfloat16", "lean_bfloat16"):
        model = kmp.convert(base, policy)
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),  # lean: LeanOptimizer
            loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        losses = [float(model.train_on_batch(x[i], y[i])) for i in range(STEPS)]
        state = kmp.state_bytes(model)
        print(
            f"{policy:15s} {type(model.optimizer).__name__:14s} "
            f"state {state.per_parameter:5.2f} bytes/parameter "
            f"({state.total / 2**20:.2f} MiB), loss {losses[0]:.3f} -> "
            f"{np.mean(losses[-5:]):.3f} nats/byte"
        )


if __name__ == "__main__":
    main()
