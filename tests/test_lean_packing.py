"""The packed lean update (`keras_mp.lean.packing`) gives `lean_rule`'s bits exactly: with
each variable's state in its own arrays (`pack_small=False`, grouped for the step) and with
the small variables' state kept packed in shared buffers (`pack_small`, the default)."""

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.lean import packing
from keras_mp.lean.codecs import blocks_for
from keras_mp.lean.rule import Static, lean_rule


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
        pack_small=False,
    ),
    "sgd-nesterov-kahan16-bfloat16": lambda: kmp.LeanOptimizer(
        keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
        rounding="kahan16",
        moments="bfloat16",
        pack_small=False,
    ),
    "adamw-stochastic-int4": lambda: kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-2, weight_decay=0.1),
        rounding="stochastic",
        moments="int4",
        pack_small=False,
    ),
    "adam-stochastic-float32": lambda: kmp.LeanOptimizer(
        keras.optimizers.Adam(1e-2), rounding="stochastic", moments="float32", pack_small=False
    ),
}


@pytest.mark.parametrize(
    "name",
    # the default state runs in every pass; kahan + int8 packed is also compared with the
    # per-variable rule by test_a_non_finite_gradient_keeps_only_its_own_variable
    [
        n if n == "adamw-stochastic-int4" else pytest.param(n, marks=pytest.mark.slow)
        for n in CONFIGS
    ],
)
def test_packed_update_gives_each_variables_bits(name):
    base = _model()
    packed = _train(base, CONFIGS[name], pack=True)
    alone = _train(base, CONFIGS[name], pack=False)
    assert _state(*packed) == _state(*alone)
    assert _state(*packed) != _state(*_train(base, CONFIGS[name], pack=True, steps=2))


def test_a_non_finite_gradient_skips_the_whole_step():
    """One variable's NaN gradient keeps every weight and state row, packed or not, as
    float16's scaler does; only the skip counter moves (`iterations` counts updates
    applied, as under kmp.LossScaleOptimizer)."""
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
        everything = list(model.weights) + optimizer.variables
        changed = [everything[i] for i, (a, b) in enumerate(zip(before, after)) if a != b]
        assert {id(v) for v in changed} == {id(optimizer.skipped_steps)}
        assert int(np.asarray(optimizer.skipped_steps.value)) == 1
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


def _compiled(fn):
    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=True, autograph=False)


def _expected_step(optimizer, grads, variables) -> list:
    """The bytes of every weight and optimizer variable after one step of `grads`, computed
    variable by variable with `lean_rule` on each one's rows of its packed group's state:
    a variable without a gradient (None) keeps its weight and rows; one non-finite
    gradient skips the whole step (every weight and row kept, the skip counted)."""
    skip = any(g is not None and not np.all(np.isfinite(np.asarray(g))) for g in grads)
    if skip:
        grads = [None] * len(grads)
    hyper = optimizer._hyper()
    rate = optimizer.learning_rate
    weights = [np.asarray(v.value).tobytes() for v in variables]
    state = {id(v): np.asarray(v.value).copy() for v in optimizer.variables}
    for i, (grad, variable) in enumerate(zip(grads, variables)):
        slot = optimizer._slots[optimizer._get_variable_index(variable)]
        assert slot["group"] is not None, variable.path
        if grad is None:
            continue
        static, (start, count) = slot["static"], slot["rows"]
        group = optimizer._group_state[slot["group"]]
        offset, size = slot["values"]  # the compensation's values: one after the other
        rows = {
            name: keras.ops.convert_to_tensor(
                state[id(v)][offset : offset + size].reshape(static.shape)
                if name == "compensation"
                else state[id(v)][start : start + count]
            )
            for name, v in group.items()
        }
        own = packing.unstack(rows, (static,))[0]
        values = {
            **optimizer._values(grad, variable, rate, optimizer._get_variable_index(variable)),
            **own,
        }
        new = _compiled(lambda values, st=static: lean_rule(st, hyper, values))(values)
        weights[i] = np.asarray(keras.ops.convert_to_numpy(new.pop("weight"))).tobytes()
        back = packing.stack((static,), [{**own, **new}])
        for name, v in group.items():
            if name == "compensation":
                value = keras.ops.convert_to_numpy(new["compensation"])
                state[id(v)][offset : offset + size] = np.asarray(value).reshape(-1)
            else:
                value = keras.ops.convert_to_numpy(back[name])
                state[id(v)][start : start + count] = np.asarray(value)
    state[id(optimizer.iterations)] = state[id(optimizer.iterations)] + int(not skip)
    state[id(optimizer.skipped_steps)] = state[id(optimizer.skipped_steps)] + int(skip)
    return weights + [state[id(v)].tobytes() for v in optimizer.variables]


PACKED = {
    "adamw-stochastic-int4": lambda: kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-2, weight_decay=0.1)
    ),
    "adamw-kahan-int8": lambda: kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-2, weight_decay=0.1), rounding="kahan", moments="int8"
    ),
    "sgd-nesterov-kahan16-bfloat16": lambda: kmp.LeanOptimizer(
        keras.optimizers.SGD(1e-2, momentum=0.9, nesterov=True),
        rounding="kahan16",
        moments="bfloat16",
    ),
}


@pytest.mark.parametrize(
    "name",
    [
        n if n == "adamw-stochastic-int4" else pytest.param(n, marks=pytest.mark.slow)
        for n in PACKED
    ],
)
@pytest.mark.parametrize("case", ["finite", "nan", "missing"])
def test_packed_state_gives_each_variables_bits(name, case):
    base = _model()
    model, optimizer = _train(base, PACKED[name], pack=True, steps=2)
    variables = model.trainable_variables
    assert optimizer._groups and all(s["group"] is not None for s in optimizer._slots)
    rng = np.random.default_rng(3)
    grads = [keras.ops.cast(rng.normal(size=v.shape) * 1e-2, "float32") for v in variables]
    kernel = next(i for i, v in enumerate(variables) if tuple(v.shape) == (16, 70))
    if case == "nan":
        grads[kernel] = keras.ops.full(variables[kernel].shape, float("nan"), "float32")
    expected = _expected_step(
        optimizer,
        [None if (case == "missing" and i == kernel) else g for i, g in enumerate(grads)],
        variables,
    )
    before = np.asarray(variables[kernel].value).tobytes()
    if case == "missing":  # Keras drops a variable without a gradient from the step
        grads[kernel] = None
    _apply(optimizer, grads, variables)
    after = [np.asarray(v.value).tobytes() for v in list(variables) + optimizer.variables]
    assert after == expected
    assert (after[kernel] == before) == (case != "finite")


def test_packed_state_layout_and_config():
    base = _model()
    model, optimizer = _train(base, PACKED["adamw-stochastic-int4"], pack=True, steps=1)
    names = sorted(v.name for v in optimizer.variables)
    # every variable of this model is under 65536 values: a group of 4-bit moments (blocks
    # of 128 values, each variable in whole blocks) and one of float32 moments (the
    # 3-value bias)
    assert "small0_momentum" in names and "small1_momentum" in names
    assert not any("dense" in n for n in names), names
    assert optimizer.get_config()["pack_small"] is True
    # a config without it (a file saved before pack_small) keeps one state per variable
    config = {k: v for k, v in optimizer.get_config().items() if k != "pack_small"}
    assert kmp.LeanOptimizer.from_config(config).pack_small is False
    with pytest.raises(ValueError, match="pack_small"):
        kmp.LeanOptimizer(keras.optimizers.Adam(), pack_small="yes")


def test_a_state_of_another_layout_does_not_load_silently():
    base = _model()
    model, optimizer = _train(base, PACKED["adamw-stochastic-int4"], pack=True, steps=1)
    store = {str(i): np.asarray(v.value) for i, v in enumerate(optimizer.variables)}
    other = kmp.LeanOptimizer(keras.optimizers.AdamW(1e-2, weight_decay=0.1), pack_small=False)
    other.build(model.trainable_variables)
    before = [np.asarray(v.value).tobytes() for v in other.variables]
    assert len(other.variables) != len(store)
    with pytest.raises(ValueError, match=r"state has \d+ variables, this optimizer \d+"):
        other.load_own_variables(store)
    assert [np.asarray(v.value).tobytes() for v in other.variables] == before
    # the same layout loads
    again = kmp.LeanOptimizer(keras.optimizers.AdamW(1e-2, weight_decay=0.1))
    again.build(model.trainable_variables)
    again.load_own_variables(store)
    assert [np.asarray(v.value).tobytes() for v in again.variables] == [
        store[str(i)].tobytes() for i in range(len(store))
    ]
