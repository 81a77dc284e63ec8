"""LeanOptimizer's general path: any Keras optimizer's own update on the lean state."""

import keras
import numpy as np
import pytest
from _lean_helpers import assert_resume_bit_identical, np_, train_batches
from _lean_helpers import data as _data
from _lean_helpers import mlp as _mlp
from _lean_helpers import train as _train

import keras_mp as kmp
from keras_mp.lean import general as lean_general

# name: (the optimizer, the slots it keeps per weight: 8-bit moments under kahan + int8)
OPTIMIZERS = {
    "rmsprop": (lambda: keras.optimizers.RMSprop(1e-3), 1),
    "adagrad": (lambda: keras.optimizers.Adagrad(5e-2), 1),
    "adadelta": (lambda: keras.optimizers.Adadelta(1.0), 2),
    "adamax": (lambda: keras.optimizers.Adamax(3e-3), 2),
    "nadam": (lambda: keras.optimizers.Nadam(2e-3), 2),
    "ftrl": (lambda: keras.optimizers.Ftrl(2e-1), 2),
    "lion": (lambda: keras.optimizers.Lion(1e-3), 1),
    "adafactor": (lambda: keras.optimizers.Adafactor(1e-2), 1),
    "lamb": (lambda: keras.optimizers.Lamb(1e-2), 2),
    "adam_amsgrad": (lambda: keras.optimizers.Adam(2e-3, amsgrad=True), 3),
}
if hasattr(keras.optimizers, "Muon"):  # Keras >= 3.11
    OPTIMIZERS["muon"] = (lambda: keras.optimizers.Muon(1e-2), 1)

# The final loss of 12 steps under lean_bfloat16 is within this fraction of
# mixed_bfloat16's (measured: 0.15% at most, on both backends).
TOLERANCE = 0.02


def _loss_after(model, opt, steps):
    x, y = _data(160)
    model.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    for i in range(steps):
        j = i % 5
        model.train_on_batch(x[j * 32 : j * 32 + 32], y[j * 32 : j * 32 + 32])
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    return float(loss(y, model(x)))


def _stock_muon_fails() -> str | None:
    """Keras 3.12's own Muon fails on TensorFlow (its update reads `variable.path` off the
    raw `tf.Variable` TF's optimizer hands it): why, or None where stock Muon runs."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Muon(1e-2), loss="mse")
    try:
        model.train_on_batch(np.zeros((2, 4), "float32"), np.zeros((2, 2), "float32"))
    except AttributeError as e:
        return f"stock keras.optimizers.Muon fails on Keras {keras.__version__} itself: {e}"
    return None


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_trains_like_mixed_bfloat16(name):
    if name == "muon" and (why := _stock_muon_fails()):
        pytest.skip(why)
    make, slots = OPTIMIZERS[name]
    # float32 weights and float32 slots: the optimizer's own update, exactly
    ref = _train(_mlp(), make(), steps=2)
    got = _train(_mlp(), kmp.LeanOptimizer(make(), moments="float32"), steps=2)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # lean_bfloat16 (bfloat16 weights + int8 compensation, 8-bit slots: kahan + int8, the
    # default before 2026-12-03; the default stochastic + int4 on the general path:
    # tests/test_lean_int4.py::test_int4_general_path) vs mixed_bfloat16
    mixed = _loss_after(kmp.convert(_mlp(), "mixed_bfloat16"), make(), 12)
    model = kmp.convert(_mlp(), "lean_bfloat16")
    opt = kmp.LeanOptimizer(make(), rounding="kahan", moments="int8")
    lean = _loss_after(model, opt, 12)
    assert abs(lean - mixed) <= TOLERANCE * mixed, (lean, mixed)
    assert lean < 1.1, lean  # it trains: the initial loss is 1.17 (TF), 1.28 (JAX)
    # the state: 2 (weight) + 1 (compensation) + about 1 byte per slot a parameter; the
    # float32 small tensors (the 3-value bias) and Adafactor's float32 rows and columns add
    # up to 0.5 here
    state = kmp.state_bytes(model)
    assert 3 + slots <= state.per_parameter <= 3.5 + slots, str(state)
    assert state.weights == 2 * state.parameters and state.compensation == state.parameters
    # the wrapped copy's own slots hold no values (lazy, never initialized)
    for slot, owner, _ in opt._general.slots:
        if owner is not None:
            assert slot._value is None, slot.path


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.RMSprop(
            keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5),
            weight_decay=0.1,
            global_clipnorm=0.5,
        ),
        lambda: keras.optimizers.Lion(1e-3, gradient_accumulation_steps=2),
    ],
    ids=["schedule_decay_clipping", "accumulation"],
)
def test_schedules_decay_clipping_and_accumulation_match_keras(make):
    ref = _train(_mlp(), make(), steps=4)
    got = _train(_mlp(), kmp.LeanOptimizer(make(), moments="float32"), steps=4)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_compile_with_any_optimizer_name_gives_lean():
    model = kmp.convert(_mlp(), "lean_bfloat16")
    model.compile(optimizer="rmsprop", loss="mse")
    assert isinstance(model.optimizer, kmp.LeanOptimizer)
    assert model.optimizer.kind == "rmsprop"
    for bad in (kmp.LossScaleOptimizer(keras.optimizers.Adam()),):
        with pytest.raises(ValueError, match="one plain Keras optimizer"):
            kmp.LeanOptimizer(bad)


@pytest.mark.filterwarnings("ignore:Gradients do not exist")
def test_non_finite_gradient_changes_nothing():
    model = kmp.convert(_mlp(), "lean_bfloat16")
    opt = kmp.LeanOptimizer(keras.optimizers.Nadam(1e-2))
    x, y = _data(32)
    _loss_after(model, opt, 2)
    before = [np_(v.value) for v in model.trainable_variables + opt.variables]
    grads = [np.full(v.shape, np.nan, "float32") for v in model.trainable_variables]
    grads[0][0, 0] = np.inf
    opt.apply(grads, model.trainable_variables)
    after = [np_(v.value) for v in model.trainable_variables + opt.variables]
    for v, a, b in zip(model.trainable_variables + opt.variables, before, after):
        if v is not opt._iterations and v is not opt.skipped_steps:
            np.testing.assert_array_equal(a, b, err_msg=v.path)
    assert int(np_(opt.skipped_steps.value)) == 1
    # a step without a gradient for a variable (None) updates the others only
    grads = [np.full(v.shape, 0.1, "float32") for v in model.trainable_variables]
    opt.apply(grads[:-1] + [None], model.trainable_variables)
    moved = [np.any(np_(v.value) != a) for v, a in zip(model.trainable_variables, after)]
    assert moved == [True, True, True, False]


def test_save_load_and_resume_bit_identical(tmp_path):
    x, y = _data(64)
    model = kmp.convert(_mlp(), "lean_bfloat16")
    loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.RMSprop(1e-3, momentum=0.5), loss=loss)
    train_batches(model, x, y, 0, 3)
    loaded = assert_resume_bit_identical(model, str(tmp_path / "lean.keras"), x, y)
    assert isinstance(loaded.optimizer, kmp.LeanOptimizer)
    assert loaded.optimizer.kind == "rmsprop"
    assert loaded.optimizer._general.inner.momentum == 0.5


def test_unsigned_slots_use_the_unsigned_map():
    model = _mlp()
    opt = kmp.LeanOptimizer(keras.optimizers.RMSprop(centered=True, momentum=0.9))
    opt.build(model.trainable_variables)
    kinds = {}
    for slot, owner, storage in opt._general.slots:
        if owner == 0:
            kinds[slot.name.rsplit("kernel_", 1)[1]] = storage[4]
    assert kinds == {"velocity": True, "momentum": False, "average_gradient": False}
    assert lean_general.UNSIGNED_SLOTS[0] == "velocity"
