"""Dynamic and static loss scaling: the optimizer that runs the pure rule.

The rule (`update_loss_scale`, in `keras_mp.scaling.loss_scale_rule`, re-exported here) is a pure
function of (state, grads-finite) written in `keras.ops`, so it runs inside the compiled
train step on every backend with no host synchronisation. `LossScaleOptimizer` subclasses
Keras' own, so `model.compile` and Keras' auto-wrapping under `mixed_float16` keep working,
and it uses the same rule on the stateful path (TensorFlow, PyTorch) and on
`stateless_apply` (JAX).
"""

from __future__ import annotations

import dataclasses
import warnings

import keras
import numpy as np
from keras import ops

from keras_mp.keras_glue import keras_internals
from keras_mp.scaling.grad_finite import is_sparse as _is_sparse
from keras_mp.scaling.grad_finite import per_variable_finite as _per_variable_finite
from keras_mp.scaling.grad_finite import sparse_values as _values
from keras_mp.scaling.grad_finite import with_static_shape as _with_static_shape
from keras_mp.scaling.loss_scale_marks import NOT_SCALED_MESSAGE, mark_scaled, take_scaled
from keras_mp.scaling.loss_scale_rule import (
    LossScaleConfig,
    LossScaleState,
    initial_loss_scale_state,
    update_loss_scale,
)

__all__ = [
    "LossScaleConfig",
    "LossScaleOptimizer",
    "LossScaleState",
    "initial_loss_scale_state",
    "update_loss_scale",
]


_STATE_VARIABLES = {
    # LossScaleState field -> optimizer variable attribute
    "scale": "dynamic_scale",
    "good_steps": "step_counter",
    "hysteresis_left": "hysteresis_left",
    "skipped_steps": "skipped_steps",
    "last_overflow_step": "last_overflow_step",
    "nonfinite_mask": "nonfinite_mask",
}


@keras.saving.register_keras_serializable(package="keras_mp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Loss-scaling optimizer with bounded dynamic scaling, hysteresis and telemetry.

    Wraps `inner_optimizer`. Each step the loss is multiplied by the current scale;
    the gradients are checked for inf/NaN and unscaled in float32 before the inner
    optimizer sees them (so its `clipnorm`/`global_clipnorm` clip true gradients).
    A step with any non-finite gradient is skipped: no weight, no optimizer slot and
    no `iterations` change. The scale follows `update_loss_scale`, which keeps it
    finite and inside `[min_scale, max_scale]`.

    Unlike stock Keras (no bounds, no hysteresis), the scale is capped at
    `max_scale=2**24` and floored at `min_scale=1`. The default `initial_scale` is
    stock Keras' `2**15`: at 2**16 (just above float16's largest value, 65504) any
    gradient element of magnitude 1 overflows, and the first steps of fresh
    transformers were skipped where 2**15 skipped none (docs/loss-scaling.md).

    Telemetry, kept as optimizer variables (saved, restored and synchronised like any
    other): `dynamic_scale` (alias `loss_scale`), `step_counter` (consecutive good
    steps), `hysteresis_left`, `skipped_steps`, `last_overflow_step` and
    `nonfinite_mask` (which variables had non-finite gradients in the last overflow;
    see `nonfinite_variable_names()`).

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap (not itself a
            `LossScaleOptimizer`).
        initial_scale: starting scale.
        growth_interval: consecutive finite steps before the scale grows.
        growth_factor: growth multiplier (> 1).
        backoff_factor: backoff multiplier in (0, 1).
        min_scale: floor of the scale.
        max_scale: ceiling of the scale.
        hysteresis: overflows tolerated before backing off.
        dynamic: `False` for a static scale fixed at `initial_scale`.
        name: optimizer name.

    With `initial_scale=1, dynamic=False` (`skip_only`) nothing is scaled: the optimizer
    only skips and counts non-finite steps. Compiling a model under a keras_mp
    `"mixed_bfloat16"` or `"float32"` policy gives it that (`keras_mp.scaling.autoscale`), so one
    NaN batch never reaches the weights under any policy.

    Example:

    >>> opt = LossScaleOptimizer(keras.optimizers.AdamW(1e-3), initial_scale=2.0**15)
    >>> model.compile(optimizer=opt, loss="mse")  # doctest: +SKIP
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        dynamic: bool = True,
        name: str | None = None,
        **kwargs,
    ):
        if "dynamic_growth_steps" in kwargs:  # stock Keras' name for the same thing
            growth_interval = kwargs.pop("dynamic_growth_steps")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "LossScaleOptimizer: `inner_optimizer` is already a LossScaleOptimizer "
                f"({inner_optimizer.name!r}); wrapping it again would scale the loss twice. "
                "Pass its `inner_optimizer` instead."
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "LossScaleOptimizer: `inner_optimizer` must be a keras.optimizers.Optimizer, "
                f"got {type(inner_optimizer).__name__}."
            )
        config = LossScaleConfig(
            initial_scale=initial_scale,
            growth_interval=growth_interval,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            dynamic=dynamic,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=growth_interval,
            name=name,
            **kwargs,
        )
        self.loss_scale_config = config
        import keras_mp.scaling.optimizer_guard as optimizer_guard

        optimizer_guard.exempt(inner_optimizer)  # it gets scaled gradients from here

    # -- arguments, as read-only views of the config ---------------------------------

    growth_interval = property(lambda self: self.loss_scale_config.growth_interval)
    growth_factor = property(lambda self: self.loss_scale_config.growth_factor)
    backoff_factor = property(lambda self: self.loss_scale_config.backoff_factor)
    min_scale = property(lambda self: self.loss_scale_config.min_scale)
    max_scale = property(lambda self: self.loss_scale_config.max_scale)
    hysteresis = property(lambda self: self.loss_scale_config.hysteresis)
    dynamic = property(lambda self: self.loss_scale_config.dynamic)

    @property
    def loss_scale(self):
        """The current loss scale: a float32 variable once the optimizer is built (by its
        first step, or `build`), before that the initial scale (a float32 scalar), which
        the first step uses."""
        if not self.built:
            return ops.convert_to_tensor(self.loss_scale_config.initial_scale, "float32")
        return self.dynamic_scale

    @property
    def skip_only(self) -> bool:
        """True for a static scale of 1 (`initial_scale=1, dynamic=False`: what compile
        gives a bfloat16 or float32 model under a keras_mp policy): the gradients are
        applied as they are, a non-finite step skipped and counted."""
        config = self.loss_scale_config
        return not config.dynamic and config.initial_scale == 1.0

    # Read by keras_mp.scaling.optimizer_guard: no warning about Keras' division is due.
    tells_unscaled_gradients = True

    def scale_loss(self, loss):
        """Multiplies `loss` by the current scale, and marks this step's gradients scaled.

        `apply` and `stateless_apply` divide the gradients by the scale only when this was
        called since the previous step (in the same trace of a compiled step); gradients of
        a loss that was never scaled are applied as they are, with a warning the first time.

        Args:
            loss: the loss (a scalar tensor).

        Returns:
            `loss * scale`.
        """
        mark_scaled(self)
        if self.skip_only:
            return loss
        return super().scale_loss(loss)

    def _scaled_this_step(self) -> bool:
        scaled = take_scaled(self)
        if self.skip_only:
            return False  # nothing to divide by, nothing to warn about
        if not scaled and not getattr(self, "_warned_not_scaled", False):
            self._warned_not_scaled = True
            warnings.warn(NOT_SCALED_MESSAGE.format(name=self.name), UserWarning, stacklevel=4)
        return scaled

    def _config_for(self, scaled: bool) -> LossScaleConfig:
        """An unscaled step leaves the scale where it is (it has not reached the loss)."""
        if scaled:
            return self.loss_scale_config
        return dataclasses.replace(self.loss_scale_config, dynamic=False)

    # -- state ---------------------------------------------------------------------

    def build(self, var_list):
        # Built with tracking off, as Keras' own wrapper builds it, a variable the inner
        # optimizer keeps as a plain attribute (Nadam's `_u_product`) is left out of its
        # `variables`: JAX's stateless step dropped its update (a wrapped Nadam trained
        # differently from a plain one) and saving dropped its value. It is adopted here, at
        # the end of the list, whatever the caller's tracking (see `load_own_variables`).
        with keras_internals.DotNotTrackScope():
            self.inner_optimizer.build(var_list)
        adopted = keras_internals.untracked_optimizer_variables(self.inner_optimizer, var_list)
        keras_internals.track_optimizer_variables(self.inner_optimizer, adopted)
        self._adopted = len(adopted)
        self._build_own(var_list)

    @keras_internals.no_automatic_dependency_tracking
    def _build_own(self, var_list):
        init = initial_loss_scale_state(self.loss_scale_config, len(var_list))

        def add(name, value, dtype):
            return self.add_variable(
                shape=tuple(value.shape),
                dtype=dtype,
                initializer=keras.initializers.Constant(value)
                if value.ndim == 0
                else keras.initializers.Zeros(),
                # Every replica computes the same state (the finiteness flags are
                # all-reduced first), so the first replica's value is the value; unlike
                # "none", this also lets the no-merge-call path assign in replica context.
                aggregation="only_first_replica",
                name=name,
            )

        # Same names and order as stock Keras for the first two (checkpoint compatible).
        self.step_counter = add("step_counter", init.good_steps, "int32")
        self.dynamic_scale = add("dynamic_scale", init.scale, "float32")
        self.hysteresis_left = add("hysteresis_left", init.hysteresis_left, "int32")
        self.skipped_steps = add("skipped_steps", init.skipped_steps, "int32")
        self.last_overflow_step = add("last_overflow_step", init.last_overflow_step, "int32")
        self.nonfinite_mask = add("nonfinite_mask", init.nonfinite_mask, "int32")
        keras.optimizers.Optimizer.build(self, var_list)

    def _read_state(self) -> LossScaleState:
        return LossScaleState(**{f: getattr(self, a).value for f, a in _STATE_VARIABLES.items()})

    def _write_state(self, state: LossScaleState) -> None:
        for f, a in _STATE_VARIABLES.items():
            getattr(self, a).assign(getattr(state, f))

    def _step_index(self):
        return ops.cast(self.iterations, "int32") + ops.cast(self.skipped_steps, "int32")

    def _unscale(self, grads, trainable_variables, scale, scaled=True):
        """Divides scaled gradients by `scale` in float32 (`scaled=False`: as they are);
        a dense gradient of unknown static shape gets its variable's."""
        out = []
        for g, v in zip(grads, trainable_variables):
            g = _with_static_shape(g, v)
            if g is None or not scaled or self._overwrite_variable_with_gradient(v):
                out.append(g)
                continue
            values = _values(g)
            unscaled = ops.cast(ops.divide(ops.cast(values, "float32"), scale), values.dtype)
            out.append(type(g)(unscaled, g.indices, g.dense_shape) if _is_sparse(g) else unscaled)
        return out

    # -- stateless path (JAX) ------------------------------------------------------

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if not self.built:
            raise ValueError(
                "To call `stateless_apply`, LossScaleOptimizer must be built (i.e. its "
                "variables must have been created). Call `optimizer.build(trainable_variables)`."
            )
        n_own = len(self._variables)
        own_values = list(optimizer_variables[:n_own])
        inner_values = list(optimizer_variables[n_own:])
        scaled = self._scaled_this_step()
        per_var = _per_variable_finite(grads)
        finite = ops.all(per_var)
        mapping = list(zip(self._variables, own_values)) + list(
            zip(self.inner_optimizer.variables, inner_values)
        )
        with keras.StatelessScope(state_mapping=mapping) as scope:
            state = self._read_state()
            step = self._step_index()
            unscaled = self._unscale(grads, self._trainable_variables, state.scale, scaled)
            applied_trainable, applied_inner = self.inner_optimizer.stateless_apply(
                inner_values, unscaled, trainable_variables
            )

            # A skipped step keeps every weight and slot: a select, not a branch. XLA fuses
            # the select into the update's kernels; a conditional passing the state through
            # would copy every weight and slot per step on XLA:GPU.
            def keep_if_skipped(applied, before):
                return [ops.where(finite, a, b) for a, b in zip(applied, before)]

            new_trainable = keep_if_skipped(applied_trainable, trainable_variables)
            new_inner = keep_if_skipped(applied_inner, inner_values)
            self._write_state(update_loss_scale(state, per_var, step, self._config_for(scaled)))
            new_own = [scope.get_current_value(v) for v in self._variables]
        return list(new_trainable), new_own + list(new_inner)

    # -- stateful path (TensorFlow, PyTorch) -----------------------------------------

    def _apply_and_update(self, grads, trainable_variables, per_var, scaled):
        """Skip-or-apply, then the rule; `per_var` is already decided across replicas."""
        finite = ops.all(per_var)
        tvs = trainable_variables or self._trainable_variables
        state = self._read_state()
        step = self._step_index()
        unscaled = self._unscale(grads, tvs, state.scale, scaled)

        def apply_fn():
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

        ops.cond(finite, apply_fn, lambda: None)
        self._write_state(update_loss_scale(state, per_var, step, self._config_for(scaled)))

    def apply(self, grads, trainable_variables=None):
        """Applies one (possibly skipped) step to the variables.

        On JAX, where a stateful `cond` cannot assign, this runs `stateless_apply` on
        the current values and assigns the results, so custom loops work there too.

        Args:
            grads: the scaled gradients, one per trainable variable.
            trainable_variables: the variables (default: those given to `build`).
        """
        if keras.backend.backend() != "jax" or keras_internals.in_stateless_scope():
            return super().apply(grads, trainable_variables)
        if not self.built:
            self.build(trainable_variables)
        tvs = list(trainable_variables or self._trainable_variables)
        new_tvs, new_ovs = self.stateless_apply(
            [v.value for v in self.variables], grads, [v.value for v in tvs]
        )
        for ref, value in zip(tvs, new_tvs):
            ref.assign(value)
        for ref, value in zip(self.variables, new_ovs):
            ref.assign(value)

    def _common_apply(self, grads, trainable_variables=None):
        scaled = self._scaled_this_step()
        self._apply_and_update(grads, trainable_variables, _per_variable_finite(grads), scaled)

    def _tf_apply(self, grads, trainable_variables=None):
        from keras_mp.tf.loss_scale_apply import apply_in_replica

        apply_in_replica(self, grads, trainable_variables)

    # -- helpers -------------------------------------------------------------------

    def nonfinite_variable_names(self) -> list[str]:
        """Paths of the variables whose gradients were non-finite in the last overflow.

        Returns:
            A list of variable paths (empty before the first overflow).
        """
        if not self.built:
            return []
        mask = keras.ops.convert_to_numpy(self.nonfinite_mask.value)
        return [v.path for v, m in zip(self._trainable_variables, mask) if m]

    def set_weights(self, weights):
        """Sets the optimizer's variables from a list of arrays (`get_weights`' order).

        Keras' legacy `.h5` loader builds the optimizer on `model._trainable_variables`,
        which is empty for a Sequential or functional model, before it sets the saved
        values: `nonfinite_mask` (one entry per trained variable) then has no entries while
        the saved one has one per variable. That saved mask is left out (it only names the
        variables of the last overflow) so the scale and its counters are restored as
        stock Keras restores its own, instead of the whole state being dropped with
        "Error in loading the saved optimizer state".

        Args:
            weights: a list of arrays, as `get_weights()` returns.
        """
        weights = list(weights)
        if self.built and tuple(self.nonfinite_mask.shape) == (0,):
            index = next(i for i, v in enumerate(self._variables) if v is self.nonfinite_mask)
            if index < len(weights) and np.shape(weights[index]) != (0,):
                weights[index] = np.zeros((0,), "int32")
        super().set_weights(weights)

    def load_own_variables(self, store):
        """Keras' loading; a file written before keras_mp kept the inner optimizer's
        attribute variables (Nadam's `_u_product`, the last ones) loads all but those,
        which keep their initial values, with a warning."""
        saved = len(store.keys())
        adopted = getattr(self, "_adopted", 0)
        if self.built and adopted and saved == len(self.variables) - adopted:
            for i, variable in enumerate(self.variables[:saved]):
                variable.assign(store[str(i)])
            names = [v.path for v in self.variables[saved:]]
            warnings.warn(
                f"{type(self).__name__} {self.name!r}: the file holds no value for "
                f"{names} (written by Keras' own LossScaleOptimizer, or by keras_mp before "
                "it kept them); they start from their initial values.",
                UserWarning,
                stacklevel=2,
            )
            return
        super().load_own_variables(store)

    def get_config(self):
        config = super().get_config()
        config.pop("dynamic_growth_steps", None)
        config.update(dataclasses.asdict(self.loss_scale_config))
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if "dynamic_growth_steps" in config:
            config["growth_interval"] = config.pop("dynamic_growth_steps")
        return super().from_config(config, custom_objects=custom_objects)
