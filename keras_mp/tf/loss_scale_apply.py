"""The loss-scale optimizer's step on TensorFlow, where replicas of a strategy must agree
on skipping (`keras_mp.LossScaleOptimizer` calls it from `apply`)."""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_mp.scaling.grad_finite import per_variable_finite
from keras_mp.scaling.loss_scale_rule import update_loss_scale
from keras_mp.tf.distribute import check_jit_compile

__all__ = ["apply_in_replica"]


def apply_in_replica(optimizer, grads, trainable_variables=None) -> None:
    """`optimizer.apply` on TensorFlow: under a strategy every replica decides on the
    same all-reduced finiteness flags, so all skip or apply together."""
    if tf.distribute.in_cross_replica_context():
        raise ValueError("apply() must be called in a replica context.")
    check_jit_compile()
    scaled = optimizer._scaled_this_step()
    # `grads` are this replica's own (the inner optimizer all-reduces them later), so
    # agree on the flags first: every replica then skips or applies together.
    ctx = tf.distribute.get_replica_context()
    per_var = per_variable_finite(grads)
    if ctx.num_replicas_in_sync > 1:
        bad = ctx.all_reduce("sum", ops.cast(ops.logical_not(per_var), "float32"))
        per_var = ops.equal(bad, 0.0)
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        optimizer._apply_and_update(grads, trainable_variables, per_var, scaled)
        return

    def cross_replica(distribution, grads, trainable_variables, per_var):
        per_var = distribution.experimental_local_results(per_var)[0]  # all equal
        finite = ops.all(per_var)
        state = optimizer._read_state()
        step = optimizer._step_index()

        def apply_fn():
            def replica_apply(grads, tvs):
                scale = optimizer.dynamic_scale.value
                unscaled = optimizer._unscale(
                    grads, tvs or optimizer._trainable_variables, scale, scaled
                )
                optimizer.inner_optimizer.apply(unscaled, trainable_variables=tvs)

            distribution.extended.call_for_each_replica(
                replica_apply, args=(grads, trainable_variables)
            )

        ops.cond(finite, apply_fn, lambda: None)
        config = optimizer._config_for(scaled)
        optimizer._write_state(update_loss_scale(state, per_var, step, config))

    ctx.merge_call(cross_replica, args=(grads, trainable_variables, per_var))
