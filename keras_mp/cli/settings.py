"""Settings of `keras-mp compare`: its choices, defaults and their checks.

Imports nothing heavy: the command line builds its parser and checks arguments from here
before any backend starts.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "DEFAULT_POLICIES",
    "JIT_MODES",
    "MODELS",
    "OPTIMIZERS",
    "SCHEDULES",
    "CompareConfig",
    "config_from_args",
]

MODELS = ("cnn", "transformer", "mlp")
DEFAULT_POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")
OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("cosine", "constant")
JIT_MODES = ("auto", "on", "off")


@dataclasses.dataclass
class CompareConfig:
    """Settings of one comparison (the `keras-mp compare` options).

    Args:
        model: `"cnn"` (digits), `"mlp"` (digits) or `"transformer"` (generated sequences).
        policies: precision modes, from `DEFAULT_POLICIES`.
        epochs: training epochs per mode.
        batch_size: batch size.
        lr: peak learning rate.
        optimizer: `"adam"` or `"sgd"` (momentum 0.9).
        schedule: `"cosine"` (decay to 0 over the run) or `"constant"`.
        jit: `"auto"` (XLA for float16 modes, Keras' default otherwise), `"on"`, `"off"`.
        seed: seed for the split, the initial weights and the batch order.
        limit: train on only this many samples (quick runs).
    """

    model: str = "cnn"
    policies: tuple = DEFAULT_POLICIES
    epochs: int = 20
    batch_size: int = 32
    lr: float = 3e-4
    optimizer: str = "adam"
    schedule: str = "cosine"
    jit: str = "auto"
    seed: int = 0
    limit: int | None = None

    def __post_init__(self):
        def choose(name, choices):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"--{name.replace('_', '-')}: {getattr(self, name)!r} is not one of "
                    f"{', '.join(choices)}."
                )

        choose("model", MODELS)
        choose("optimizer", OPTIMIZERS)
        choose("schedule", SCHEDULES)
        choose("jit", JIT_MODES)
        self.policies = tuple(self.policies)
        if not self.policies:
            raise ValueError("--policies: give at least one policy.")
        for p in self.policies:
            if p not in DEFAULT_POLICIES:
                raise ValueError(
                    f"--policies: unknown policy {p!r}; choose from {', '.join(DEFAULT_POLICIES)}."
                )
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policies: a policy is repeated in {','.join(self.policies)}.")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be a positive integer.")
        if self.limit is not None and self.limit < 8:
            raise ValueError("--limit: must be at least 8 samples.")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr: must be a positive number, got {self.lr!r}.")


def config_from_args(args) -> CompareConfig:
    """The `CompareConfig` of parsed `keras-mp compare` arguments.

    Raises:
        ValueError: on a value `CompareConfig` rejects (the message names the option).
    """
    return CompareConfig(
        model=args.model,
        policies=args.policies,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        schedule=args.schedule,
        jit={None: "auto", True: "on", False: "off"}[args.jit],
        seed=args.seed,
        limit=args.limit,
    )
