"""Settings of `keras-mp compare`: its choices, defaults and their checks.

Imports nothing heavy: the command line builds its parser and checks arguments from here
before any backend starts.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = [
    "CALIBRATED",
    "DEFAULT_POLICIES",
    "JIT_MODES",
    "MODELS",
    "OPTIMIZERS",
    "POLICIES",
    "SCHEDULES",
    "T5_POLICIES",
    "LEAN",
    "CompareConfig",
    "config_from_args",
    "lean_variant",
]

MODELS = ("cnn", "transformer", "mlp", "t5")
DEFAULT_POLICIES = (
    "float32",
    "mixed_float16",
    "mixed_bfloat16",
    "lean_bfloat16",
    "float16",
    "bfloat16",
)
# Mixed float16 with the keep-list calibrated on the training data (kmp.convert(...,
# calibrate=...)): the fix for activations past float16's range.
CALIBRATED = "mixed_float16_calibrated"
# bfloat16 weights with stochastically rounded updates and 4-bit moments (keras_mp.lean):
# ~3 bytes of training state a parameter instead of 12.
LEAN = "lean_bfloat16"
POLICIES = DEFAULT_POLICIES + (CALIBRATED,)
# --model t5 (a T5-style encoder whose feed-forward output passes 65,504, as a trained T5's
# does) shows the overflow and its fix side by side.
T5_POLICIES = ("float32", "mixed_float16", CALIBRATED, "mixed_bfloat16")
OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("cosine", "constant")
JIT_MODES = ("auto", "on", "off")


def lean_variant(policy: str) -> tuple | None:
    """`(rounding, moments)` of a policy written `lean_bfloat16:ROUNDING:MOMENTS` (the
    model under `lean_bfloat16`, its optimizer `kmp.LeanOptimizer(..., rounding=...,
    moments=...)`), None for any other name.

    Args:
        policy: a `--policies` entry.

    Returns:
        A `(rounding, moments)` tuple or None.
    """
    name, *variant = policy.split(":")
    if name != LEAN or len(variant) != 2:
        return None  # decided without importing Keras: `--help` and typos stay fast
    from keras_mp.lean import codecs, factored

    rounding, moments = variant
    if rounding not in codecs.ROUNDINGS or moments not in factored.MOMENT_CHOICES:
        return None
    return rounding, moments


@dataclasses.dataclass
class CompareConfig:
    """Settings of one comparison (the `keras-mp compare` options).

    Args:
        model: `"cnn"` (digits), `"mlp"` (digits), `"transformer"` (generated sequences) or
            `"t5"` (the same sequences, a T5-style encoder whose activations pass 65,504).
        policies: precision modes, from `POLICIES`; `None`: `T5_POLICIES` for `"t5"`,
            `DEFAULT_POLICIES` otherwise.
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
    policies: tuple | None = None
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
        if self.policies is None:
            self.policies = T5_POLICIES if self.model == "t5" else DEFAULT_POLICIES
        self.policies = tuple(self.policies)
        if not self.policies:
            raise ValueError("--policies: give at least one policy.")
        for p in self.policies:
            if p not in POLICIES and not lean_variant(p):
                raise ValueError(
                    f"--policies: unknown policy {p!r}; choose from {', '.join(POLICIES)} "
                    f"or {LEAN}:ROUNDING:MOMENTS (e.g. {LEAN}:stochastic:int4)."
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
