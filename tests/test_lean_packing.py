"""The packed lean update (`keras_mp.lean.packing`) gives `lean_rule`'s bits exactly."""

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.lean import packing
from keras_mp.lean.codecs import blocks_for
from keras_mp.lean.rule import Static


def _model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(40, 16)(inputs)
    h = keras.layers.LayerNormalization()(h)  # float32 weights (keep-list)
    h = keras.layers.Dense(70, activation="gelu")(h)  # 1120 values: blocks of 64 and a pad
    h = keras.layers.Dense(16)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    outputs = keras.layers.Dense(3)(h)  # bias of 3: float32 moments
    return keras.Model(inputs, outputs)


def _apply(optimizer, grads, variables) -> None:
    """`optimizer.apply` compiled, as in a train step (eager arithmetic may round apart)."""
    if keras.backend.backend() == "jax":
        import jax

        values = [v.value for v in variables]
        state = [v.value for v in optimizer.variables]
        new_values, new_state = jax.jit(optimizer.stateless_apply)(state, grads, values)
        for v, x in zip(list(variables) + list(optimizer.variables), new_values + new_state):
            v.assign(x)
    else:
        import tensorflow as tf

        tf.function(lambda: optimizer.apply(grads, variables))()


def _state(model, optimizer) -> list:
    return [np.asarray(v.value).tobytes() for v in model.weights + optimizer.variables]


def _train(base, make, pack: bool, steps: int = 3) -> tuple:
    model = kmp.convert(base, "lean_bfloat16")
    optimizer = make()
    optimizer._pack_updates = pack
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError())
    rng = np.random.default_rng(0)
    x = rng.integers(0, 40, (8, 6)).astype("int32")
    y = rng.normal(size=(8, 3)).astype("float32")
    for _ in range(steps):
        model.train_on_batch(x, y)
    return model, optimizer


CONFIGS = {
    "adamw-kahan-int8": lambda: kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-2, weight_decay=0.1),
        rounding="kahan",
        moments="int8",
        block_size=64,
    ),
    "sgd-nesterov-kahan16-bfloat16": lambda: kmp.LeanOptimizer(
        keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
        rounding="kahan16",
        moments="bfloat16",
    ),
    "adamw-stochastic-int4": lambda: kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-2, weight_decay=0.1), rounding="stochastic", moments="int4"
    ),
    "adam-stochastic-float32": lambda: kmp.LeanOptimizer(
        keras.optimizers.Adam(1e-2), rounding="stochastic", moments="float32"
    ),
}


@pytest.mark.parametrize(
    "name",
    # the default state runs in every pass; kahan + int8 packed is also compared with the
    # per-variable rule by test_a_non_finite_gradient_keeps_only_its_own_variable
    [n if n == "adamw-stochastic-int4" else pytest.param(n, marks=pytest.mark.slow)
     for n in CONFIGS],
)
def test_packed_update_gives_each_variables_bits(name):
    base = _model()
    packed = _train(base, CONFIGS[name], pack=True)
    alone = _train(base, CONFIGS[name], pack=False)
    assert _state(*packed) == _state(*alone)
    assert _state(*packed) != _state(*_train(base, CONFIGS[name], pack=True, steps=2))


def test_a_non_finite_gradient_keeps_only_its_own_variable():
    base = _model()
    results = []
    for pack in (True, False):
        model, optimizer = _train(base, CONFIGS["adamw-kahan-int8"], pack=pack, steps=1)
        before = _state(model, optimizer)
        variables = model.trainable_variables
        grads = [keras.ops.full(v.shape, 1e-3, "float32") for v in variables]
        kernel = next(i for i, v in enumerate(variables) if tuple(v.shape) == (16, 70))
        grads[kernel] = keras.ops.full(variables[kernel].shape, float("nan"), "float32")
        _apply(optimizer, grads, variables)
        after = _state(model, optimizer)
        results.append(after)
        assert np.asarray(variables[kernel].value).tobytes() == before[kernel]
        changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert kernel not in changed and len(changed) > len(variables)
    assert results[0] == results[1]


def test_groups_pack_alike_small_variables_and_leave_large_ones_alone():
    def static(shape, m="int8", dtype="bfloat16"):
        return Static(shape, dtype, m, m, blocks_for(shape, 64))

    statics = [static((64,)), static((8, 8)), static((64,), dtype="float32"), static((300, 300))]
    found = packing.groups(statics, [True, True, True, True], largest=65536)
    assert [g.indices for g in found] == [(0, 1), (2,), (3,)]
    assert [g.indices for g in packing.groups(statics, [True, False, True, True], 65536)] == [
        (0,),
        (1,),
        (2,),
        (3,),
    ]
    # a sparse gradient (its own square) never shares a group with dense ones
    squares = [False, True, False, False]
    found = packing.groups(statics, [True] * 4, 65536, squares=squares)
    assert [g.indices for g in found] == [(0,), (1,), (2,), (3,)]
    sharded = Static((8, 8), "bfloat16", "int8", "int8", blocks_for((8, 8), 64, (2, 1)))
    assert not packing.packable(sharded)
    assert packing.packable(static((8, 8), m="int4"))
