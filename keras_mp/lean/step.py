"""The lean optimizer's step: float32 gradients, one skip for a non-finite step, the rule.

`LeanStep` is the part of `LeanOptimizer` (`keras_mp.lean.optimizer`) that applies a step:
gradients taken to float32, every gradient made NaN when one is not finite (the whole step
skipped, counted in `skipped_steps`), and each variable's update by the pure rule
(`keras_mp.lean.rule`), per variable, per packed group (`keras_mp.lean.packed_step`), or
by the Pallas kernel (`keras_mp.lean.kernel`).
"""

from __future__ import annotations

import functools

import keras
from keras import ops

from keras_mp.lean import packed_step
from keras_mp.lean.rule import (
    Hyper,
    Static,
    dense_gradient,
    lean_rule,
    read,
    to_float32,
    variable_seed,
)
from keras_mp.scaling.grad_finite import is_sparse, per_variable_finite

__all__ = ["LeanStep"]


def trainable_variables_unknown(variables, grads) -> bool:
    """Whether the variables the gradients belong to are not known one to one (an
    optimizer not built yet: Keras builds it inside `apply`)."""
    return variables is None or len(variables) != len(grads)


class LeanStep:
    """`LeanOptimizer`'s update (a mixin: it reads the optimizer's state and settings)."""

    def apply(self, grads, trainable_variables=None):
        """Applies one step; gradients are taken to float32 first (clipping included)."""
        if getattr(self, "update_in_backward", False):
            raise RuntimeError(
                f"LeanOptimizer {self.name!r} has update_in_backward=True: its updates run "
                "inside the backward pass of the model's fit (keras_mp.lean.in_backward), "
                "not from gradients applied afterwards. Compile the model with keras_mp "
                "imported (or call keras_mp.lean.in_backward.attach(model) after compile), "
                "or build the optimizer with update_in_backward=False for a custom loop."
            )
        variables = trainable_variables or getattr(self, "_trainable_variables", None)
        raw = self._raw_gradients(grads, variables)
        grads = [g if g is None or r else to_float32(g) for g, r in zip(grads, raw)]
        # One inf or NaN anywhere skips the whole step, as float16's scaler does: every
        # gradient is then made NaN, so each variable's update keeps its weight and
        # moments (a select XLA fuses into the update; a finite step passes through).
        # A large matrix updated in row blocks (`keras_mp.lean.chunked`) keeps its
        # gradient as it came and gets the step's finiteness instead (`_values`): a
        # poisoned float32 copy would be made whole as the blocks' loop operand.
        finite = ops.all(per_variable_finite(grads))
        grads = [g if g is None or r else _poisoned(g, finite) for g, r in zip(grads, raw)]
        self._raw = {id(v) for v, r in zip(variables, raw) if r}
        self._step_finite = finite
        try:
            result = super().apply(grads, trainable_variables)
        finally:
            self._raw, self._step_finite = set(), None
        # counted as float16's skipped steps are (`LossScaleMonitor`, `Telemetry`); and, as
        # under kmp.LossScaleOptimizer, a skipped step is no update: `iterations` (the
        # learning-rate schedule's step, Adam's bias correction) counts applied updates.
        skipped = ops.cast(ops.logical_not(finite), "int32")
        self.skipped_steps.assign_add(skipped)
        if not self.gradient_accumulation_steps:  # there Keras counts micro-steps
            self._iterations.assign_sub(ops.cast(skipped, self._iterations.dtype))
        return result

    def _raw_gradients(self, grads, variables) -> list:
        """Per gradient: whether it goes to the update as it came (`chunked.raw_gradient`:
        a large matrix, dense, the fused rule, no Keras-side clipping, scaling or
        accumulation, which would act on it before it is taken to float32)."""
        from keras_mp.lean import chunked

        plain = (
            self._general is None
            and self._kernel == "xla"
            and not (self.clipnorm or self.clipvalue or self.global_clipnorm)
            and not self.gradient_accumulation_steps
            and not self.loss_scale_factor
        )
        if plain and keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            plain = not tf.distribute.has_strategy()  # replicas' variables: not by id
        if not plain or trainable_variables_unknown(variables, grads):
            return [False] * len(grads)
        return [
            g is not None and not is_sparse(g) and chunked.raw_gradient(v)
            for g, v in zip(grads, variables)
        ]

    def _apply_weight_decay(self, variables):
        return  # decoupled decay is part of update_step, in float32

    def _inputs(self, gradient, variable, learning_rate) -> tuple:
        """`(static, values, writes)` of one variable's update: what `lean_rule` is
        specialised on, its inputs, and the variables its outputs are assigned to."""
        index = self._get_variable_index(variable)
        slot = self._slots[index]
        values = self._values(gradient, variable, learning_rate, index)
        writes = {"weight": variable}
        if slot["compensation"] is not None:
            values["compensation"] = read(slot["compensation"])
            writes["compensation"] = slot["compensation"]
        for name in ("m", "v"):
            if slot[name] is not None:
                _, codes, scales = slot[name]
                values[name], writes[name] = read(codes), codes
                if scales is not None:
                    values[name + "_scale"], writes[name + "_scale"] = read(scales), scales
        static = Static(
            shape=tuple(variable.shape),
            weight_dtype=keras.backend.standardize_dtype(variable.dtype),
            m=None if slot["m"] is None else slot["m"][0],
            v=None if slot["v"] is None else slot["v"][0],
            blocks=slot["blocks"],
        )
        return static, values, writes

    def _values(self, gradient, variable, learning_rate, index: int) -> dict:
        """A variable's `lean_rule` inputs other than its stored state."""
        gradient, square = dense_gradient(gradient)
        values = {
            "weight": read(variable),
            "grad": gradient,
            "lr": ops.cast(learning_rate, "float32"),
            "iterations": ops.cast(self.iterations, "int32"),
            "seed": ops.convert_to_tensor(variable_seed(index), "int32"),
        }
        if square is not None:
            values["grad_square"] = square
        if id(variable) in getattr(self, "_raw", ()):  # as it came: `apply`
            values["step_finite"] = self._step_finite
        if self._decays(variable):
            values["weight_decay"] = ops.cast(self.weight_decay, "float32")
        return values

    def _write(self, new: dict, writes: dict) -> None:
        for name, target in writes.items():
            self.assign(target, new[name])

    def update_step(self, gradient, variable, learning_rate):
        if self._general is not None:
            raise NotImplementedError(
                f"LeanOptimizer({self.kind}): the general path updates all variables at "
                "once; it does not run under a tf.distribute strategy (Adam, AdamW and SGD "
                "do)."
            )
        if self._slots[self._get_variable_index(variable)]["group"] is not None:
            raise RuntimeError(  # the packed groups update together (_backend_update_step)
                f"LeanOptimizer: {variable.path!r} is updated with its packed group, not "
                "on its own (pack_small)."
            )
        static, values, writes = self._inputs(gradient, variable, learning_rate)
        new = self._kernel_rule(static, values)
        self._write(self._rule_for(static)(values) if new is None else new, writes)

    def _kernel_rule(self, static: Static, values: dict) -> dict | None:
        """One variable's new state by `keras_mp.lean.kernel` where it is chosen
        (`KERAS_MP_LEAN_KERNEL=pallas`, JAX, no distribution) and applies; else None
        (`lean_rule`'s turn)."""
        if self._kernel == "pallas" and keras.backend.backend() == "jax":
            from keras_mp.lean import kernel as lean_kernel

            hyper = self._hyper()
            if keras.distribution.distribution() is None and lean_kernel.applies(
                static, hyper, values
            ):
                return lean_kernel.lean_kernel_rule(static, hyper, values)
        return None

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        """All variables' updates: each packed group of small variables (`pack_small`, or
        on TensorFlow the variables under `_SMALL` values grouped for the step) as one,
        each larger variable on its own, all behind one finiteness test. On TensorFlow
        the whole update is one XLA computation that reads and writes the variables
        itself (`packed_step.compiled_update`); on JAX it is traced into the step. Under a
        `tf.distribute` strategy, each group and each larger variable in the strategy's
        update context (`_distributed_tf_update_step`)."""
        if self._general is not None and grads:
            if keras.backend.backend() == "tensorflow":
                import tensorflow as tf

                if tf.distribute.has_strategy():
                    return super()._backend_update_step(grads, trainable_variables, learning_rate)
            return self._general.apply(self, grads, trainable_variables, learning_rate)
        loose = not self._groups and (
            not self._pack_updates or keras.distribution.distribution() is not None
        )
        if not grads or loose:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            if tf.distribute.has_strategy():
                return super()._backend_update_step(grads, trainable_variables, learning_rate)
            return packed_step.compiled_update(self, grads, trainable_variables, learning_rate)
        packed_step.packed_update(self, grads, trainable_variables, learning_rate)

    def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
        """TensorFlow under a `tf.distribute` strategy: Keras' per-variable update for the
        variables with a state of their own; each packed group in the update context of
        its first member, its members and state read and written there (each replica's
        own copies)."""
        members, alone = packed_step.by_group(self, grads_and_vars)
        if alone:
            super()._distributed_tf_update_step(distribution, alone, learning_rate)

        def group_update(anchor, k, grads, variables, learning_rate):
            del anchor  # the update context's variable: the group's first member
            packed_step.group_update(self, k, grads, variables, learning_rate, guard=True)

        for k, (grads, variables) in members.items():
            distribution.extended.update(
                variables[0],
                group_update,
                args=(k, grads, variables, learning_rate),
                group=False,
            )

    def _rule_for(self, static: Static):
        """The pure update for variables like `static`; on TensorFlow compiled with XLA
        (one fused kernel per shape, whether or not the train step itself is), elsewhere
        as it is (JAX traces it into the step)."""
        rule = functools.partial(lean_rule, static, self._hyper())
        if keras.backend.backend() != "tensorflow":
            return rule
        cache = self.__dict__.setdefault("_compiled_rules", {})
        if static not in cache:
            import tensorflow as tf

            cache[static] = tf.function(rule, jit_compile=True, autograph=False)
        return cache[static]

    def _hyper(self) -> Hyper:
        return Hyper(
            kind=self.kind,
            rounding=self.rounding,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            epsilon=self.epsilon,
            momentum=self.momentum,
            nesterov=self.nesterov,
        )


def _poisoned(g, finite):
    """`g` where `finite`, else NaN (a sparse gradient's values likewise)."""
    nan = ops.full((), float("nan"), "float32")
    if is_sparse(g):
        return type(g)(ops.where(finite, g.values, nan), g.indices, g.dense_shape)
    return ops.where(finite, g, nan)
