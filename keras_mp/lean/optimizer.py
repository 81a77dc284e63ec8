"""The lean training state: bfloat16 weights with unbiased updates, compact moments.

`LeanOptimizer` runs Adam, AdamW or SGD (with or without momentum) with the update
arithmetic in float32 inside the train step, and stores what persists between steps
compactly (`keras_mp.lean.codecs`): by default bfloat16 weights rounded stochastically
a block-wise 4-bit first moment and a factored second one (about 2.55 bytes a parameter
on a large transformer; 4-bit both, 3.06, from 2026-12-03; `rounding="kahan"` with
`moments="int8"`, 5 bytes, was the default before 2026-12-03). Any other Keras optimizer
(RMSprop, Adafactor, Lion, Muon...) keeps the same storage and runs its own update on
the decoded float32 state (`keras_mp.lean.general`). The optimizer's variables are built by
`keras_mp.lean.state` and its step runs in `keras_mp.lean.step`; this module holds its
arguments, config and float32 views. Under the `"lean_bfloat16"` policy a model's
trainable weights are bfloat16 (the keep-list's layers keep float32 weights) and
`compile(optimizer="adamw")` gets a `LeanOptimizer` by itself (`keras_mp.scaling.autoscale`).
Float32 weights are updated exactly; only their moments are compressed.
"""

from __future__ import annotations

import collections
import os

import keras
from keras import ops

import keras_mp.scaling.optimizer_guard as optimizer_guard
from keras_mp.lean import codecs as lean_codecs
from keras_mp.lean import factored, int4
from keras_mp.lean import general as lean_general
from keras_mp.lean.rule import read
from keras_mp.lean.state import LeanState
from keras_mp.lean.step import LeanStep

__all__ = ["DEFAULT_MOMENTS", "DEFAULT_ROUNDING", "LeanOptimizer", "SUPPORTED"]

# The default state, chosen by measurement (docs/lean.md, "The defaults, by measurement"):
# stochastic rounding, a 4-bit first moment and a factored second one (2026-12-05; 4-bit
# both until then), the lightest state within 1% of float32's validation loss on every
# seed of benchmarks/text_lm.py (BENCHMARKS 17: about 2.55 bytes a parameter on a GPT-2,
# 2.77 on text_lm's model). Files saved with an earlier default keep theirs: the config
# names both.
DEFAULT_ROUNDING = "stochastic"
DEFAULT_MOMENTS = "int4_factored"

# Optimizer classes whose state LeanOptimizer knows how to keep (exact types: a subclass
# may change the update rule, which would be silently replaced).
SUPPORTED = {
    keras.optimizers.Adam: "adam",
    keras.optimizers.AdamW: "adamw",
    keras.optimizers.SGD: "sgd",
}
_BY_NAME = {v: k for k, v in SUPPORTED.items()}
_BASE_ARGS = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


# How JAX runs the update of a variable with 4-bit moments: "xla" (`lean_rule`, traced
# into the step) or "pallas" (`keras_mp.lean.kernel`: one Triton kernel a variable on
# a GPU, Pallas' interpreter elsewhere). Opt-in until a GPU measures it (BENCHMARKS 16.5).
KERNEL_ENV = "KERAS_MP_LEAN_KERNEL"
KERNELS = ("xla", "pallas")


def _kernel_choice() -> str:
    choice = os.environ.get(KERNEL_ENV, "xla").strip().lower() or "xla"
    if choice not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected one of {KERNELS}.")
    return choice


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(
            f"LeanOptimizer: invalid `{name}`={value!r}. Expected one of {list(choices)}."
        )


@keras.saving.register_keras_serializable(package="keras_mp")
class LeanOptimizer(LeanState, LeanStep, keras.optimizers.Optimizer):
    """Any Keras optimizer with a compact persistent state and float32 update arithmetic.

    Adam, AdamW and SGD run a fused rule of their own (below); every other optimizer
    (RMSprop, Adagrad, Adadelta, Adamax, Nadam, Ftrl, Lion, Adafactor, Lamb, Muon, Adam
    with amsgrad, a subclass) takes the general path (`keras_mp.lean.general`): the same
    weight storage, its slots shaped like the weight stored as the moments are, its other
    slots in float32, and its own `update_step` run on the decoded float32 values.

    Each step the gradients are taken to float32, clipped there (the global norm is a
    float32 reduction), and every update is computed in float32 from the decoded weight
    and moments, then stored back:

    - a bfloat16 weight with `rounding="stochastic"` (the default) keeps no buffer and
      rounds up or down at random, unbiased, so updates far below the weight's bfloat16
      ulp still add up on average (2 bytes a parameter). `"kahan"` keeps what rounding to
      bfloat16 lost in an int8 compensation buffer (about 16 significant bits in all; 3
      bytes); `"kahan16"` keeps a bfloat16 buffer instead (4 bytes).
    - a float32 weight (a layer the keep-list pins) is updated exactly.
    - a step with an inf or NaN in any gradient leaves every weight and moment as they
      were, and is counted in the `skipped_steps` variable (`kmp.callbacks.LossScaleMonitor`
      logs it, as it logs float16's skipped steps), not in `iterations`, which counts the
      updates applied (as `kmp.LossScaleOptimizer`'s does).
    - the moments are stored as `moments="int4_factored"` (the default: the first moment
      as `"int4"`, the second of large matrices as float32 row and column averages),
      `"int4"` (block-wise 4-bit codes, two a byte, with a float32 scale per `block_size`
      values; about 1.06 bytes a parameter for Adam's two moments), `"int8"` (8-bit
      codes: 2 bytes),
      `"bfloat16"` or `"float32"`. Tensors smaller than `min_quantized_size` keep float32
      moments (biases and norm scales: a negligible share of the parameters).

    The optimizer's other settings (learning rate or schedule, betas, epsilon, weight
    decay and its exclusions, momentum, nesterov, clipping, EMA, gradient accumulation)
    are taken from `inner_optimizer`, which is not used after construction. With
    `use_ema` the averages are float32; with `gradient_accumulation_steps` the
    accumulators are float32 (each adds 4 bytes a parameter).

    Args:
        inner_optimizer: a Keras optimizer (not a `LossScaleOptimizer` or
            `MultiOptimizer`). Exactly `Adam` (without amsgrad), `AdamW` and `SGD` take
            the fused path.
        rounding: how bfloat16 weights absorb updates: `"stochastic"` (default),
            `"kahan"` or `"kahan16"`.
        moments: storage of the moments: `"int4_factored"` (default since 2026-12-05):
            the first moment 4-bit, the second of each tensor of rank >= 2 and 65536
            values or more factored into float32 row and column averages
            (`keras_mp.lean.factored`; smaller tensors as `"int4"`): about 2.55 bytes a
            parameter in all with the default rounding; `"int4"` (two codes a byte for
            both moments: about 3.06 bytes, the default from 2026-12-03), `"int8"` (with
            `rounding="kahan"`: 5 bytes, the default before 2026-12-03), `"bfloat16"`,
            `"float32"`.
        block_size: values per scale of the quantized moments (default: 2048 for
            `"int8"`, 128 for `"int4"`).
        min_quantized_size: tensors with fewer elements keep float32 moments.
        shard_over_data: split the state across the data-parallel axis of the
            `keras.distribution` in effect (ZeRO stage 1, JAX): each of N data-parallel
            devices keeps 1/N of the compensation buffers and moments. Without it the
            state is placed like the weights (split under `ModelParallel`, whole on every
            device under `DataParallel`). See docs/distributed.md.
        pack_small: keep the state of the variables under 65536 values (biases, norm
            scales, small kernels) in a few shared buffers, one per group of alike
            variables (same weight dtype, moment formats and weight decay), each variable
            in whole blocks of its own (at most 128 values a scale), and update each group
            as one: a few arrays and kernels a step instead of five per variable (default;
            not with `shard_over_data` or the general path, which keep one state per
            variable). Files saved before 2026-12-04 load with `pack_small=False`, the
            layout they were written in.
        update_in_backward: JAX: `fit` updates each weight inside the backward pass as
            soon as its gradient is made, so no whole-model gradient is held
            (`keras_mp.lean.in_backward`; a first pass for the step's finiteness and
            norm: about twice the compute). Not with gradient accumulation.
        name: optimizer name.

    Example:

    ```python
    model = kmp.convert(model, "lean_bfloat16")
    model.compile(optimizer="adamw", loss=...)          # gets a LeanOptimizer by itself
    # or explicitly, for an optimizer you configure:
    opt = kmp.LeanOptimizer(keras.optimizers.AdamW(3e-4, weight_decay=0.1))
    ```
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        rounding: str = DEFAULT_ROUNDING,
        moments: str = DEFAULT_MOMENTS,
        block_size: int | None = None,
        min_quantized_size: int = 64,
        shard_over_data: bool = False,
        pack_small: bool = True,
        update_in_backward: bool = False,
        name: str | None = None,
        **kwargs,
    ):
        if isinstance(inner_optimizer, LeanOptimizer):
            raise ValueError(
                "LeanOptimizer: `inner_optimizer` is already a LeanOptimizer; pass the "
                "Adam/AdamW/SGD it was made from."
            )
        lean_general.check(inner_optimizer)
        kind = SUPPORTED.get(type(inner_optimizer))
        general = None
        if kind is None or getattr(inner_optimizer, "amsgrad", False):
            # any other optimizer: its own update on the decoded state (lean_general)
            general = lean_general.GeneralState(inner_optimizer)
            kind = general.kind
        _check_choice("rounding", rounding, lean_codecs.ROUNDINGS)
        _check_choice("moments", moments, factored.MOMENT_CHOICES)
        for arg, value in (("block_size", block_size), ("min_quantized_size", min_quantized_size)):
            if value is None and arg == "block_size":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"LeanOptimizer: invalid `{arg}`={value!r}: expected a positive integer."
                )
        rate = inner_optimizer._learning_rate
        if isinstance(rate, keras.Variable):
            from keras_mp.numerics.recast import (
                host_value,  # NumPy 2 warns on np.array(tf.Variable)
            )

            rate = float(host_value(rate))
        base = {a: getattr(inner_optimizer, a) for a in _BASE_ARGS}
        super().__init__(learning_rate=rate, name=name or f"lean_{kind}", **base, **kwargs)
        self.kind = kind
        self._general = general  # a plain object: neither tracked nor saved
        self.rounding = rounding
        self.moments = moments
        self.block_size = block_size
        self.min_quantized_size = min_quantized_size
        if not isinstance(shard_over_data, bool):
            raise ValueError(
                f"LeanOptimizer: invalid `shard_over_data`={shard_over_data!r}: expected True "
                "or False."
            )
        self.shard_over_data = shard_over_data
        if not isinstance(pack_small, bool):
            raise ValueError(
                f"LeanOptimizer: invalid `pack_small`={pack_small!r}: expected True or False."
            )
        self.pack_small = pack_small
        if not isinstance(update_in_backward, bool):
            raise ValueError(
                "LeanOptimizer: invalid `update_in_backward`="
                f"{update_in_backward!r}: expected True or False."
            )
        self.update_in_backward = update_in_backward
        if update_in_backward:
            from keras_mp.lean import in_backward

            in_backward.check(self)
        # Small variables that keep a state of their own (`pack_small=False`, a layout
        # split across devices) are grouped for each step (`packing.stack`) on TensorFlow;
        # on JAX each is traced into the step (XLA fuses them there).
        self._pack_updates = keras.backend.backend() == "tensorflow"
        self._kernel = _kernel_choice()
        self.beta_1 = float(getattr(inner_optimizer, "beta_1", 0.9))
        self.beta_2 = float(getattr(inner_optimizer, "beta_2", 0.999))
        self.epsilon = float(getattr(inner_optimizer, "epsilon", 1e-7))
        self.momentum = float(getattr(inner_optimizer, "momentum", 0.0))
        self.nesterov = bool(getattr(inner_optimizer, "nesterov", False))
        for attr in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
            if hasattr(inner_optimizer, attr):
                setattr(self, attr, getattr(inner_optimizer, attr))
        optimizer_guard.exempt(self)  # it keeps lean weights exact: no plain-optimizer warning

    @property
    def block_length(self) -> int:
        """Values per scale of the quantized moments: `block_size`, or by default 2048 for
        `"int8"` and `keras_mp.lean.int4.BLOCK` (128) for `"int4"`."""
        if self.block_size is not None:
            return self.block_size
        return int4.BLOCK if factored.first_format(self.moments) == "int4" else 2048

    @property
    def general(self) -> bool:
        """Whether the optimizer runs the general path (its own update, decoded state)."""
        return self._general is not None

    def weights_float32(self) -> list:
        """The float32 values the trainable weights stand for (bfloat16 weight plus its
        compensation), in the order of the variables the optimizer was built with.

        Returns:
            A list of float32 tensors.
        """
        if not self.built:
            raise ValueError("LeanOptimizer.weights_float32(): the optimizer is not built.")
        out = []
        for variable, slot in zip(self._trainable_variables, self._slots):
            comp = slot["compensation"]
            if slot["group"] is not None:
                comp = self._group_state[slot["group"]].get("compensation")
                if comp is not None:
                    start, size = slot["values"]
                    comp = ops.reshape(comp.value[start : start + size], variable.shape)
                    out.append(lean_codecs.decode_weight(variable.value, comp, self.rounding))
                    continue
            out.append(
                lean_codecs.decode_weight(
                    variable.value, None if comp is None else comp.value, self.rounding
                )
            )
        return out

    def load_own_variables(self, store):
        """Keras' loading, with a clear error where Keras would skip the state with a
        warning: a file whose optimizer holds a different number of variables (the model's
        variables differ from the saved model's, or its small variables' state was packed
        otherwise: `pack_small`, the distribution it was built under). A file saved before
        the first step (compiled, never trained) holds only the step count and learning
        rate: they are loaded and the state starts fresh, as it would have."""
        saved = len(store.keys())
        if saved and self.built and saved == len(self.variables) - 1:
            # written before the skip counter (the last variable) existed: it starts at 0
            for i, variable in enumerate(self.variables[:-1]):
                variable.assign(store[str(i)])
            return
        if saved and self.built and saved == getattr(self, "_unbuilt_count", None):
            for i, variable in enumerate(self.variables[:saved]):
                variable.assign(store[str(i)])
            return
        if saved and self.built and saved != len(self.variables):
            dtypes = collections.Counter(
                keras.backend.standardize_dtype(v.dtype) for v in self._trainable_variables
            )
            here = ", ".join(f"{n} {d}" for d, n in sorted(dtypes.items()))
            raise ValueError(
                f"LeanOptimizer {self.name!r}: the file's optimizer state has {saved} "
                f"variables, this optimizer {len(self.variables)} (built for the model's "
                f"{len(self._trainable_variables)} trainable variables: {here}): the state "
                "was laid out for other variables or settings. Most often a layer loaded in "
                "another dtype than it was saved in: a custom layer whose get_config() "
                "omits its dtype loads in float32 (take **kwargs in __init__, pass them to "
                "super().__init__(**kwargs), and return {**super().get_config(), ...} from "
                "get_config()). Otherwise the small variables' state was packed differently "
                f"(pack_small={self.pack_small} here; not packed under shard_over_data or "
                "for a variable split across devices): build the optimizer as the saved one "
                "was."
            )
        super().load_own_variables(store)

    # -- EMA in float32 --------------------------------------------------------------------

    def _update_model_variables_moving_average(self, trainable_variables):
        if not self.use_ema:
            return
        first = ops.equal(self.iterations, 0)
        momentum = ops.where(first, 0.0, ops.cast(self.ema_momentum, "float32"))
        for var, average in zip(trainable_variables, self._model_variables_moving_average):
            if average is None:
                continue
            value = ops.cast(read(var), "float32")
            average.assign(momentum * average.value + (1.0 - momentum) * value)

    def _overwrite_model_variables_with_average_value(self, trainable_variables):
        for var, average in zip(trainable_variables, self._model_variables_moving_average):
            if average is not None:
                var.assign(ops.cast(average.value, var.dtype))

    # -- config ----------------------------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        own = {
            "rounding": self.rounding,
            "moments": self.moments,
            "block_size": self.block_size,
            "min_quantized_size": self.min_quantized_size,
            "shard_over_data": self.shard_over_data,
            "pack_small": self.pack_small,
        }
        if self.update_in_backward:
            own["update_in_backward"] = True
        if self._general is not None:
            inner_config = dict(self._general.serialized)
            inner_config["config"] = {
                **inner_config["config"],
                "learning_rate": config["learning_rate"],
            }
            config.update({"optimizer": inner_config, **own})
            return config
        inner = {
            "adam": ("beta_1", "beta_2", "epsilon"),
            "adamw": ("beta_1", "beta_2", "epsilon"),
            "sgd": ("momentum", "nesterov"),
        }[self.kind]
        config.update({"optimizer": self.kind, **{k: getattr(self, k) for k in inner}, **own})
        return config

    def plain_optimizer(self) -> keras.optimizers.Optimizer:
        """A new Keras optimizer with this one's settings, for float32 weights (a lean
        model converted to a mixed or float32 policy): Adam, AdamW, SGD or the optimizer
        the general path runs. Its state starts afresh.

        Returns:
            A `keras.optimizers.Optimizer`.
        """
        return _split_config(self.get_config())[0]

    @classmethod
    def from_config(cls, config, custom_objects=None):
        inner, own = _split_config(config, custom_objects)
        return cls(inner, **own)


def _split_config(config: dict, custom_objects=None) -> tuple:
    """`(inner optimizer, LeanOptimizer's own arguments)` from a `get_config()`."""
    config = dict(config)
    own = {
        k: config.pop(k)
        for k in (
            "rounding",
            "moments",
            "block_size",
            "min_quantized_size",
            "shard_over_data",
            "pack_small",
            "update_in_backward",
            "name",
        )
        if k in config
    }
    # files written before pack_small existed hold one state per variable
    own.setdefault("pack_small", False)
    kind = config.pop("optimizer")
    if isinstance(kind, dict):  # the general path: the optimizer's own config
        return keras.optimizers.deserialize(kind, custom_objects=custom_objects), own
    rate = config.get("learning_rate")
    if isinstance(rate, dict):
        config["learning_rate"] = keras.saving.deserialize_keras_object(
            rate, custom_objects=custom_objects
        )
    return _BY_NAME[kind](**config), own
