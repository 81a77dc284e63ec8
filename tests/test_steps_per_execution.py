"""keras_mp's per-step work inside Keras' multi-step execution (`steps_per_execution`).

Keras 3.16 runs JAX's `steps_per_execution` as one on-device `lax.scan` (keras PR 23527),
Keras up to 3.15 as a host loop, TensorFlow as a `tf.while_loop`. The loss-scale update,
the lean finiteness test and the skipped-step counters are optimizer variables updated
inside the compiled step, so N steps in one execution must give exactly what N executions
of one step give: the same weights, the same scale, the same skip count.
"""

import keras
import numpy as np
import pytest

import keras_mp as kmp


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 16)).astype("float32")
    y = rng.integers(0, 4, 96).astype("int32")
    x[37] = np.nan  # one non-finite sample: its step (batch 2) must be skipped
    return x, y


def _fit(policy: str, steps_per_execution: int):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)]
    )
    model = kmp.convert(model, policy)
    model.compile(
        optimizer="adam",
        loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    x, y = _data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    weights = [np.asarray(keras.ops.convert_to_numpy(v), "float64") for v in model.weights]
    opt = model.optimizer
    counters = {
        name: float(keras.ops.convert_to_numpy(getattr(opt, name)))
        for name in ("skipped_steps", "loss_scale", "iterations")
        if getattr(opt, name, None) is not None
    }
    return weights, counters


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16", "lean_bfloat16"])
def test_multi_step_execution_matches_one_step_at_a_time(policy):
    one_w, one_c = _fit(policy, 1)
    many_w, many_c = _fit(policy, 4)
    assert one_c["skipped_steps"] == many_c["skipped_steps"] == 1  # the NaN batch
    assert one_c == many_c
    for a, b in zip(one_w, many_w):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a, b)
