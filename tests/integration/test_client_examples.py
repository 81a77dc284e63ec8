"""Client code of the kinds keras.io trains in mixed precision, converted and trained.

A siamese RoBERTa encoder (a subclassed container never called before conversion), GPT-2
fine-tuned with LoRA, the float8 transformer recipe and a DreamBooth-style trainer with
its own `compute_loss` (see `client_examples`), each at a tiny size on synthetic data,
under both mixed policies, with the loss-scale callbacks in the callback list as users
keep them when they switch the policy. JAX's CPU has no float16 dot: the JAX pass trains
them under mixed_bfloat16.
"""

import client_examples
import keras
import numpy as np
import pytest

import keras_mp as kmp

POLICIES = ["mixed_float16", "mixed_bfloat16"]


def _skip_float16_on_jax(policy):
    if policy == "mixed_float16" and keras.backend.backend() == "jax":
        pytest.skip("JAX's CPU has no float16 dot")


def _numpy(v):
    return np.asarray(keras.ops.convert_to_numpy(v), dtype="float32")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", client_examples.KINDS)
def test_client_example_trains_under_both_mixed_policies(kind, policy):
    _skip_float16_on_jax(policy)
    low = policy.removeprefix("mixed_")
    monitor, guard = kmp.callbacks.LossScaleMonitor(), kmp.callbacks.CollapseGuard()
    model, mixed, history = client_examples.train(
        kind, policy, epochs=3, callbacks=[monitor, guard, kmp.callbacks.NonFiniteGuard()])
    losses = history.history["loss"]
    assert len(losses) == 3 and np.all(np.isfinite(losses)), losses
    if kind != "lora":  # LoRA moves few weights: 6 steps barely move the loss
        assert losses[-1] < losses[0], losses
    assert not mixed.stop_training
    # The converted model computes in the low dtype, and says so at every level.
    dense = [x for x in mixed._flatten_layers(include_self=False)
             if isinstance(x, keras.layers.Dense) and x.compute_dtype != "float32"]
    assert dense and all(x.compute_dtype == low for x in dense)
    for sub in mixed._flatten_layers(include_self=True):
        if isinstance(sub, keras.Model) and sub.path not in mixed.precision_plan.float32:
            assert sub.compute_dtype == low, sub.name
    if policy == "mixed_float16":
        assert isinstance(mixed.optimizer, kmp.LossScaleOptimizer)
        assert len(history.history["loss_scale"]) == 3
        assert monitor.idle_reason is None
    else:  # bfloat16: no scale, but a non-finite step is skipped and counted
        assert isinstance(mixed.optimizer, kmp.LossScaleOptimizer)
        config = mixed.optimizer.loss_scale_config
        assert (config.dynamic, config.initial_scale) == (False, 1.0)
        assert "loss_scale" not in history.history
        assert history.history["skipped_steps"] == [0, 0, 0]
        assert monitor.idle_reason is None and guard.idle_reason is None
    # Master weights stay float32, and the original model is untouched.
    assert all(v.dtype == "float32" for v in mixed.trainable_variables)
    assert all(v.dtype == "float32" for v in model.trainable_variables)


@pytest.mark.parametrize("policy", POLICIES)
def test_lora_fine_tune_moves_only_the_lora_weights(policy):
    _skip_float16_on_jax(policy)
    model, data = client_examples.build("lora")
    mixed = kmp.convert(model, policy)
    before = {v.path: _numpy(v) for v in mixed.weights}
    trainable = {v.path for v in mixed.trainable_variables}
    # What LoRA leaves trainable (the LoRA factors, and biases) is what the user's had.
    assert trainable == {v.path for v in model.trainable_variables}
    assert any("lora" in p for p in trainable)
    assert not any(p.endswith("/kernel") or "embeddings" in p for p in trainable)
    client_examples._compile("lora", mixed)
    mixed.fit(x=data[0], y=data[1], sample_weight=data[2], batch_size=8, epochs=2, verbose=0)
    moved = {v.path for v in mixed.weights
             if v.path in before and not np.array_equal(before[v.path], _numpy(v))}
    # The LoRA B matrices start at zero and move; frozen weights do not.
    assert moved and moved <= trainable
    assert any("lora_kernel_b" in p for p in moved)
