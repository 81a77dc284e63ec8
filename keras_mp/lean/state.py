"""The lean optimizer's variables: compact moments, compensation buffers, packed groups.

`LeanState` is the part of `LeanOptimizer` (`keras_mp.lean.optimizer`) that builds its
persistent state: each variable's moments in their storage format (`keras_mp.lean.codecs`,
`keras_mp.lean.factored`), a bfloat16 weight's compensation buffer, and the packed groups
that hold the small variables' state together (`keras_mp.lean.packed_step`).
"""

from __future__ import annotations

import math

import keras

from keras_mp.keras_glue.keras_internals import no_automatic_dependency_tracking
from keras_mp.lean import codecs as lean_codecs
from keras_mp.lean import factored, packing
from keras_mp.lean import sharding as lean_sharding
from keras_mp.lean.packed_step import SMALL as _SMALL
from keras_mp.lean.rule import Static, constant

__all__ = ["LeanState"]

_FLAT_BLOCK = 128  # the longest block of a packed group's quantized moments
_LABELS = ("momentum", "velocity")  # the moments' names in the optimizer's variables


def _codes_dtype(fmt: str) -> str:
    """The storage dtype of a moment in format `fmt` (its codes, for a quantized one)."""
    return {"int8": "uint8", "int4": "uint8", "bfloat16": "bfloat16"}.get(fmt, "float32")


class LeanState:
    """`LeanOptimizer`'s state building (a mixin: it reads the optimizer's settings)."""

    def _moment_format(self, variable) -> str:
        size = 1
        for d in variable.shape:
            size *= int(d)
        moments = factored.first_format(self.moments)  # "int4_factored": int4 but `v`
        if moments in lean_codecs.QUANTIZED and size < self.min_quantized_size:
            return "float32"
        return moments

    def _formats(self, variable) -> tuple:
        """`(first, second)`: the formats of `variable`'s moments, None for a moment its
        update has none of (SGD: a first moment with momentum only; no second)."""
        fmt = self._moment_format(variable)
        if self.kind in ("adam", "adamw"):
            return fmt, factored.second_format(self.moments, variable.shape, fmt)
        return (fmt if self.momentum > 0 else None), None

    def _compensation_dtype(self, weight_dtype: str) -> str | None:
        """The dtype of a weight's compensation buffer: int8 for `"kahan"`, bfloat16 for
        `"kahan16"`, None for a stochastically rounded or a float32 weight (none kept)."""
        if weight_dtype != "bfloat16" or self.rounding == "stochastic":
            return None
        return "int8" if self.rounding == "kahan" else "bfloat16"

    def _add_moment(self, variable, name: str, place, blocks, initial=None, fmt=None) -> tuple:
        """A moment's storage; `initial`: a callable of the format that gives the
        initial `(codes, scales)` (default: zeros); `fmt`: its format (default:
        `_moment_format`'s; `"factored"`: its row and column averages)."""
        fmt = fmt or self._moment_format(variable)
        if fmt == factored.FORMAT:
            return factored.add_accumulators(self, variable, name, place)
        initial = initial(fmt) if initial is not None else (None, None)
        codes_shape, scales_shape = lean_codecs.moment_shapes(variable.shape, fmt, blocks)
        dtype = _codes_dtype(fmt)
        prefix = variable.path.replace("/", "_")
        if scales_shape is None:
            layouts = (lean_sharding.state_layout(place, variable.shape), None)
        else:
            layouts = lean_sharding.codes_layouts(place)
        codes = self.add_variable(
            codes_shape,
            dtype=dtype,
            name=f"{prefix}_{name}",
            layout=layouts[0],
            initializer=constant(initial[0]),
        )
        scales = None
        if scales_shape is not None:
            scales = self.add_variable(
                scales_shape,
                dtype="float32",
                name=f"{prefix}_{name}_scale",
                layout=layouts[1],
                initializer=constant(initial[1]),
            )
        return fmt, codes, scales

    @no_automatic_dependency_tracking
    def build(self, var_list):
        if self.built:
            return
        self._unbuilt_count = len(self.variables)  # what a file saved before any step holds
        super().build(var_list)
        self._slots = []
        small = []  # (index, Static) of the variables whose state is packed
        for index, variable in enumerate(var_list):
            static = self._small_static(variable)
            if static is not None:
                small.append((index, static))
                self._slots.append({"compensation": None, "m": None, "v": None, "group": None})
                continue
            place = lean_sharding.placement(variable, self.shard_over_data)
            blocks = lean_sharding.blocks(place, variable.shape, self.block_length)
            slot = {"compensation": None, "m": None, "v": None, "blocks": blocks, "group": None}
            dtype = self._compensation_dtype(keras.backend.standardize_dtype(variable.dtype))
            if dtype is not None:
                slot["compensation"] = self.add_variable(
                    tuple(variable.shape),
                    dtype=dtype,
                    name=variable.path.replace("/", "_") + "_compensation",
                    layout=lean_sharding.state_layout(place, variable.shape),
                )
            if self._general is None:  # the general path adds its slots below
                for key, label, fmt in zip(("m", "v"), _LABELS, self._formats(variable)):
                    if fmt is not None:
                        slot[key] = self._add_moment(variable, label, place, blocks, fmt=fmt)
            self._slots.append(slot)
        self._groups = packing.groups(
            [static for _, static in small],
            [self._decays(var_list[index]) for index, _ in small],
        )
        self._group_state = [
            self._add_group_state(k, g.statics) for k, g in enumerate(self._groups)
        ]
        # each group's members as indices of the optimizer's variables, in the group's order
        self._members = [[small[i][0] for i in g.indices] for g in self._groups]
        for k, group in enumerate(self._groups):
            start = offset = 0
            for member, static in zip(group.indices, group.statics):
                slot = self._slots[small[member][0]]
                size = math.prod(static.shape)
                slot.update(
                    group=k,
                    static=static,
                    rows=(start, static.blocks.count),
                    values=(offset, size),
                )
                start += static.blocks.count
                offset += size
        if self._general is not None:
            self._general.build(self, var_list)
        # Last, so files saved before it existed load (`load_own_variables`).
        self.skipped_steps = self.add_variable(
            (), dtype="int32", name="skipped_steps", aggregation="only_first_replica"
        )

    def _small_static(self, variable):
        """The `Static` of a variable whose state a packed group keeps (`pack_small`: under
        `_SMALL` values, and whole on each device), with its blocks as laid out there; None
        for a variable that keeps its own state."""
        size = math.prod(variable.shape)
        if not self.pack_small or self.shard_over_data or self._general is not None:
            return None
        if size >= _SMALL:
            return None
        if any(n != 1 for n in lean_sharding.placement(variable).shards):
            return None  # split across devices (ModelParallel): its state is split alike
        fmt = self._moment_format(variable)
        formats = self._formats(variable)
        # quantized moments: whole blocks of each variable, at most _FLAT_BLOCK values a
        # scale; other formats have no blocks (rows of one value: no padding)
        length = min(self.block_length, _FLAT_BLOCK) if fmt in lean_codecs.QUANTIZED else 1
        rank = len(variable.shape)
        blocks = lean_codecs.Blocks((1,) * rank, max(1, -(-size // length)), length)
        return Static(
            shape=tuple(variable.shape),
            weight_dtype=keras.backend.standardize_dtype(variable.dtype),
            m=formats[0],
            v=formats[1],
            blocks=blocks,
        )

    def _decays(self, variable) -> bool:
        return self.weight_decay is not None and bool(self._use_weight_decay(variable))

    def _add_group_state(self, k: int, statics: tuple) -> dict:
        """The shared state variables of packed group `k` (`pack_small`): its rows of
        compensation and moments."""
        first = statics[0]
        rows = sum(st.blocks.count for st in statics)
        length = first.blocks.length
        layout = lean_codecs.Blocks((1, 1), rows, length)
        state = {}
        dtype = self._compensation_dtype(first.weight_dtype)
        if dtype is not None:
            state["compensation"] = self.add_variable(  # the members' values: no padding
                (sum(math.prod(st.shape) for st in statics),),
                dtype=dtype,
                name=f"small{k}_compensation",
            )
        for name, label in zip(("m", "v"), _LABELS):
            fmt = getattr(first, name)
            if fmt is None:
                continue
            codes_shape, scales_shape = lean_codecs.moment_shapes((rows, length), fmt, layout)
            state[name] = self.add_variable(
                codes_shape, dtype=_codes_dtype(fmt), name=f"small{k}_{label}"
            )
            if scales_shape is not None:
                state[name + "_scale"] = self.add_variable(
                    scales_shape, dtype="float32", name=f"small{k}_{label}_scale"
                )
        return state

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        """EMA averages and gradient accumulators are float32 whatever the weight's dtype."""
        if name in ("average", "gradient_accumulator") and reference_variable.dtype != "float32":
            prefix = reference_variable.path.replace("/", "_")
            return self.add_variable(
                tuple(reference_variable.shape),
                initializer=initializer,
                dtype="float32",
                name=f"{prefix}_{name}",
                layout=getattr(reference_variable, "_layout", None),
            )
        return super().add_variable_from_reference(reference_variable, name, initializer)
