"""The lean state for any Keras optimizer: decode, the optimizer's own update, encode.

`LeanOptimizer` updates Adam, AdamW and SGD with its own fused rule (`keras_mp.lean`).
Every other optimizer (RMSprop, Adagrad, Adadelta, Adamax, Nadam, Ftrl, Lion, Adafactor,
Lamb, Muon, Adam with amsgrad, a subclass) takes the general path here: each step the
bfloat16 weights (plus their compensation, if any) and the optimizer's slots are decoded to
float32, the optimizer's own `update_step` runs on them functionally (Keras'
`StatelessScope`, as its `stateless_apply` does), and the new weights and slots are
encoded back.

The wrapped optimizer is a private copy built on float32 placeholders that hold no
values: its variables are created lazily (inside a `StatelessScope`) and never
initialized, so they cost no memory; they only name the state the update reads and
writes. What persists is `LeanOptimizer`'s own variables:

- a slot shaped like its weight (a moment, an accumulator) in the `moments` format
  (8-bit block-wise by default, unsigned where the slot cannot be negative: second
  moments, accumulators, norms), or float32 below `min_quantized_size` values;
- any other slot (Adafactor's factored rows and columns, Nadam's scalar product) in its
  own dtype (float32).

On TensorFlow the copy uses Keras' backend-neutral variable handling (the TF optimizer's
`tf.distribute` overrides do not apply to mapped values), so the general path does not
run under a `tf.distribute` strategy.
"""

from __future__ import annotations

import contextlib
import functools

import keras
import numpy as np
from keras import ops

from keras_mp.keras_glue.keras_internals import (
    BaseOptimizer,
    global_state,
    untracked_optimizer_variables,
)
from keras_mp.lean import codecs as lean_codecs
from keras_mp.lean import sharding as lean_sharding
from keras_mp.lean.rule import is_sparse, noise_seed, read, variable_seed

__all__ = ["GeneralState", "REFUSED", "UNSIGNED_SLOTS"]

# Slot names (the suffix Keras gives `add_variable_from_reference`) that are never
# negative: stored with the unsigned 8-bit map (no zero point for a positive value, so
# a division by its square root cannot blow up). Every other slot is signed.
UNSIGNED_SLOTS = (
    "velocity",
    "velocity_hat",
    "accumulator",
    "accumulated_grad",
    "accumulated_delta_var",
    "norm",
)
# Optimizers that are not one update rule over per-variable state.
REFUSED = ("LossScaleOptimizer", "MultiOptimizer", "ScheduleFreeAdamW", "LeanOptimizer")
# Arguments the outer LeanOptimizer applies itself (clipping, EMA, accumulation).
_OUTER_ONLY = {
    "clipnorm": None,
    "clipvalue": None,
    "global_clipnorm": None,
    "use_ema": False,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _forget_lazy(variables) -> None:
    """Takes lazily created variables off Keras' list of variables to initialize (the
    outermost `StatelessScope` to close would otherwise give them full-size values)."""
    ids = {id(v) for v in variables}
    pending = global_state.get_global_attribute("uninitialized_variables")
    if pending:
        global_state.set_global_attribute(
            "uninitialized_variables", [v for v in pending if id(v) not in ids]
        )


class _Functional(keras.optimizers.Optimizer):
    """Keras' backend-neutral variable handling, placed after the concrete optimizer
    class and before the backend's `Optimizer` in the copy's method order: its updates
    are recorded by a `StatelessScope` on every backend, its slots are lazy, and its
    weight-decay exclusions are the `LeanOptimizer`'s (on the real variables)."""

    assign = BaseOptimizer.assign
    assign_add = BaseOptimizer.assign_add
    assign_sub = BaseOptimizer.assign_sub
    _var_key = BaseOptimizer._var_key
    _backend_update_step = BaseOptimizer._backend_update_step
    _apply_weight_decay = BaseOptimizer._apply_weight_decay
    add_variable_from_reference = BaseOptimizer.add_variable_from_reference

    def add_variable(self, *args, **kwargs):
        with keras.StatelessScope(initialize_variables=False):
            variable = BaseOptimizer.add_variable(self, *args, **kwargs)
        _forget_lazy([variable])
        return variable

    def _use_weight_decay(self, variable):
        real = self.__dict__["_lean_real"].get(id(variable))
        return self.__dict__["_lean_use_weight_decay"](real)


@functools.cache
def _functional_class(cls):
    return type(f"Lean{cls.__name__}", (cls, _Functional), {"__module__": __name__})


def check(inner) -> None:
    """Raises a `ValueError` for an optimizer the general path cannot run."""
    names = {c.__name__ for c in type(inner).__mro__}
    refused = names.intersection(REFUSED)
    if refused or not isinstance(inner, keras.optimizers.Optimizer):
        raise ValueError(
            "LeanOptimizer wraps one plain Keras optimizer (Adam, AdamW and SGD on a fused "
            "path; RMSprop, Adagrad, Adadelta, Adamax, Nadam, Ftrl, Lion, Adafactor, Lamb, "
            f"Muon and other `keras.optimizers.Optimizer`s through their own update); got "
            f"{type(inner).__name__}, which is not one update rule over per-variable state."
        )


def _lazy_initial(variable):
    """A variable's initial value: a lazy one's initializer run once, else its value."""
    if getattr(variable, "_value", None) is None and variable._initializer is not None:
        return variable._initializer(variable.shape, dtype=variable.dtype)
    return variable.value


class GeneralState:
    """The general path's state for one `LeanOptimizer` (a plain object: not tracked,
    not saved; the persistent state is the `LeanOptimizer`'s variables)."""

    def __init__(self, inner: keras.optimizers.Optimizer):
        check(inner)
        self.serialized = keras.optimizers.serialize(inner)
        config = inner.get_config()
        config.update(_OUTER_ONLY)
        self.inner = _functional_class(type(inner)).from_config(config)
        self.inner.__dict__["_lean_real"] = {}
        import keras_mp.scaling.optimizer_guard as optimizer_guard

        optimizer_guard.exempt(self.inner)  # updates float32 placeholders, as its wrapper says
        self.kind = type(inner).__name__.lower()

    def build(self, outer, var_list) -> None:
        """Builds the copy on placeholders and `outer`'s storage for each of its slots."""
        inner = self.inner
        with keras.StatelessScope(initialize_variables=False):
            placeholders = [
                keras.Variable(
                    keras.initializers.Zeros(),
                    shape=tuple(v.shape),
                    dtype="float32",
                    trainable=False,
                    name=v.name,
                )
                for v in var_list
            ]
        _forget_lazy(placeholders)
        for p, v in zip(placeholders, var_list):
            p._path = v.path  # Muon chooses its rule by path
        inner.__dict__["_lean_real"] = {id(p): v for p, v in zip(placeholders, var_list)}
        inner.__dict__["_lean_use_weight_decay"] = outer._use_weight_decay
        with _eager():  # its own variables (Nadam's scalar) with their values now
            inner.build(placeholders)
        self.placeholders = placeholders
        skip = {id(inner._iterations), id(getattr(inner, "_learning_rate", None))}
        prefixes = [v.path.replace("/", "_") + "_" for v in var_list]
        self.slots = []  # (inner variable, owner index or None, storage)
        for k, slot in enumerate(_state_variables(inner, placeholders)):
            if id(slot) in skip:
                continue
            owner = next(
                (
                    i
                    for i, (v, prefix) in enumerate(zip(var_list, prefixes))
                    if slot.name.startswith(prefix) and tuple(slot.shape) == tuple(v.shape)
                ),
                None,
            )
            with _eager():  # on TensorFlow build may run inside the traced train step
                initial = _lazy_initial(slot)
                if not np.any(ops.convert_to_numpy(initial) != 0):
                    initial = None
            if owner is not None:
                name = slot.name[len(prefixes[owner]) :]
                variable = var_list[owner]
                place = lean_sharding.placement(variable, outer.shard_over_data)
                blocks = lean_sharding.blocks(place, variable.shape, outer.block_length)
                signed = name not in UNSIGNED_SLOTS

                def encoded(fmt, initial=initial, signed=signed, blocks=blocks):
                    if initial is None:
                        return None, None
                    with _eager():
                        return lean_codecs.encode_moment(initial, fmt, signed, None, blocks)

                fmt, codes, scales = outer._add_moment(variable, name, place, blocks, encoded)
                storage = ("moment", fmt, codes, scales, not signed, blocks)
            else:
                codes = outer.add_variable(
                    tuple(slot.shape),
                    dtype=slot.dtype,
                    name=f"{inner.name}_{k}_{slot.name}",
                    initializer="zeros" if initial is None else _constant(initial),
                )
                storage = ("plain", codes)
            self.slots.append((slot, owner, storage))

    def _encode(self, storage, value, noise):
        if storage[0] == "plain":
            return (ops.cast(value, storage[1].dtype),)
        _, fmt, _, _, unsigned, blocks = storage
        return lean_codecs.encode_moment(value, fmt, not unsigned, noise, blocks)

    def _decode(self, storage, shape):
        if storage[0] == "plain":
            return read(storage[1])
        _, fmt, codes, scales, unsigned, blocks = storage
        return lean_codecs.decode_moment(
            read(codes),
            None if scales is None else read(scales),
            fmt,
            not unsigned,
            shape,
            blocks,
        )

    def apply(self, outer, grads, variables, learning_rate) -> None:
        """One step of the optimizer's own update on the decoded state of `variables`
        (those of `outer`'s that have a gradient this step), written back encoded; a
        variable whose gradient has an inf or NaN keeps its weight and slots, and the
        slots no variable owns (Nadam's product) change only when every gradient is
        finite."""
        inner = self.inner
        index = [outer._get_variable_index(v) for v in variables]
        iterations = ops.cast(outer.iterations, "int32")
        lr = ops.cast(learning_rate, "float32")
        grads_of, finite, stored = [], {}, {}
        for i, g, variable in zip(index, grads, variables):
            g = ops.reshape(ops.cast(_dense(g), "float32"), tuple(variable.shape))
            grads_of.append(g)
            finite[i] = ops.all(ops.isfinite(g))
            comp = outer._slots[i]["compensation"]
            stored[i] = (read(variable), None if comp is None else read(comp))
        all_finite = functools.reduce(ops.logical_and, finite.values())
        placeholders = [self.placeholders[i] for i in index]
        # every value the update reads, read now: reads inside the scope below see only
        # its mapping (not an enclosing stateless scope's, as JAX's train step is)
        mapping = [(inner._iterations, ops.cast(outer.iterations, inner._iterations.dtype))]
        if isinstance(getattr(inner, "_learning_rate", None), keras.Variable):
            mapping.append((inner._learning_rate, ops.cast(lr, inner._learning_rate.dtype)))
        for i, p in zip(index, placeholders):
            mapping.append((p, lean_codecs.decode_weight(*stored[i], outer.rounding)))
        for slot, _, storage in self.slots:
            mapping.append((slot, ops.cast(self._decode(storage, tuple(slot.shape)), slot.dtype)))
        with keras.StatelessScope(state_mapping=mapping, initialize_variables=False) as scope:
            before = dict(scope.state_mapping)
            inner._apply_weight_decay(placeholders)
            inner._backend_update_step(grads_of, placeholders, lr)

        def changed(variable):
            value = scope.state_mapping[id(variable)]
            return None if value is before[id(variable)] else value

        noises = {}
        for i, variable, p in zip(index, variables, placeholders):
            shape = tuple(variable.shape)
            seed = noise_seed(iterations, ops.convert_to_tensor(variable_seed(i), "int32"))
            noises[i] = lean_codecs.uniforms(shape, seed, 3)
            target = changed(p)
            if target is None:
                continue
            target = ops.cast(target, "float32")
            weight, comp = stored[i]
            compensation = outer._slots[i]["compensation"]
            if keras.backend.standardize_dtype(variable.dtype) == "bfloat16":
                w, c = lean_codecs.encode_weight(target, outer.rounding, noises[i][0])
                outer.assign(variable, ops.where(finite[i], w, weight))
                if compensation is not None:
                    outer.assign(compensation, ops.where(finite[i], c, comp))
            else:
                target = ops.cast(target, variable.dtype)
                outer.assign(variable, ops.where(finite[i], target, weight))
        used = dict.fromkeys(index, 0)
        for slot, owner, storage in self.slots:
            value = changed(slot)
            if value is None or (owner is not None and owner not in finite):
                continue
            keep = all_finite if owner is None else finite[owner]
            noise = None
            if owner is not None and storage[1] != "float32":
                k = used[owner] = used[owner] + 1
                noise = (
                    noises[owner][k]
                    if k < 3
                    else lean_codecs.uniforms(
                        tuple(slot.shape),
                        noise_seed(iterations, variable_seed(owner) + 7777 * k),
                        1,
                    )[0]
                )
            targets = storage[2:4] if storage[0] == "moment" else storage[1:]
            encoded = self._encode(storage, ops.cast(value, "float32"), noise)
            for target, value in zip(targets, encoded):
                if target is not None:
                    outer.assign(target, ops.where(keep, value, read(target)))


def _state_variables(inner, placeholders) -> list:
    """The optimizer's variables, and those it keeps as plain attributes outside its
    tracked list (Nadam's `_u_product`), in a fixed order."""
    return list(inner.variables) + untracked_optimizer_variables(inner, placeholders)


def _constant(value):
    with _eager():
        value = ops.convert_to_numpy(value)
    return lambda shape, dtype=None: ops.cast(value, dtype)


def _eager():
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.init_scope()
    return contextlib.nullcontext()


def _dense(g):
    if is_sparse(g):
        import tensorflow as tf

        return tf.convert_to_tensor(g)
    return g
