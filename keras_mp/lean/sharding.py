"""Where the lean training state lives across devices (`keras.distribution`).

A `LeanOptimizer` variable's state (the compensation buffer, the moments' codes and their
block scales) is laid out like the weight it belongs to: under `ModelParallel` a kernel
split over a "model" axis has its compensation split the same way and its quantized moments
cut into blocks that never straddle two devices (`lean_codecs.Blocks`), so every device
holds the state of its own shard and nothing else. With `shard_over_data=True` the state
is split further across the data-parallel axis (ZeRO stage 1: the weights stay as the
distribution places them, each data-parallel device keeps 1/N of the optimizer state, and
XLA's SPMD partitioner inserts the gathers of the updated weights).

On TensorFlow (`tf.distribute`) variables carry no layout: every replica holds the whole
state, as it holds the whole weight.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import numpy as np

from keras_mp.lean import codecs as lean_codecs

__all__ = ["Placement", "blocks", "codes_layouts", "per_device_bytes", "placement", "state_layout"]


class Placement(NamedTuple):
    """How one weight is split across devices, and the data axis its state may add.

    Attributes:
        mesh: the `keras.distribution.DeviceMesh` (None: no distribution).
        axes: the weight's mesh axes per dimension (a name, a tuple of names or None).
        shards: parts per dimension (the product of its mesh axes' sizes).
        data_axis: the mesh axis the state is split over in addition (None: not split).
        data_parts: the size of `data_axis` (1 when not split).
    """

    mesh: object
    axes: tuple
    shards: tuple
    data_axis: str | None
    data_parts: int


def _names(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _merge(names: tuple):
    return None if not names else names[0] if len(names) == 1 else names


def _layout(axes, mesh):
    """A layout for `axes` on `mesh`: a `keras.distribution.TensorLayout`, or where an
    axis is split over several mesh axes (which `TensorLayout` cannot say), the JAX
    `NamedSharding` it would become."""
    if all(a is None or isinstance(a, str) for a in axes):
        return keras.distribution.TensorLayout(axes, mesh)
    import jax

    return jax.sharding.NamedSharding(mesh.backend_mesh, jax.sharding.PartitionSpec(*axes))


def _weight_layout(variable):
    """The weight's `(DeviceMesh, axes)`, or None when it has no layout."""
    layout = getattr(variable, "_layout", None)
    if layout is None:
        return None
    if isinstance(layout, keras.distribution.TensorLayout):
        return layout.device_mesh, tuple(layout.axes)
    spec = getattr(layout, "spec", None)  # a jax NamedSharding given explicitly
    mesh = getattr(layout, "mesh", None)
    if spec is None or mesh is None:
        return None
    device_mesh = keras.distribution.DeviceMesh(
        tuple(mesh.devices.shape), list(mesh.axis_names), mesh.devices.flatten().tolist()
    )
    axes = tuple(spec) + (None,) * (len(variable.shape) - len(tuple(spec)))
    return device_mesh, axes


def placement(variable, shard_over_data: bool = False) -> Placement:
    """How `variable` is split across the devices of the current distribution.

    Args:
        variable: a model variable (its layout, where the distribution gave it one).
        shard_over_data: whether its optimizer state is split across the distribution's
            data-parallel axis too.

    Returns:
        A `Placement`.

    Raises:
        ValueError: `shard_over_data` without a `keras.distribution` that has a
            data-parallel axis.
    """
    rank = len(variable.shape)
    found = _weight_layout(variable)
    distribution = keras.distribution.distribution()
    if found is None and distribution is not None:
        found = distribution.device_mesh, (None,) * rank
    if found is None:
        if shard_over_data:
            raise ValueError(
                "LeanOptimizer(shard_over_data=True) splits the state across the data axis "
                "of a keras.distribution (DataParallel or ModelParallel, JAX backend); none "
                "is set. Call keras.distribution.set_distribution(...) before building the "
                "model and the optimizer, or drop shard_over_data."
            )
        return Placement(None, (None,) * rank, (1,) * rank, None, 1)
    mesh, axes = found
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    shards = tuple(math.prod(sizes[n] for n in _names(a)) for a in axes)
    data_axis, parts = None, 1
    if shard_over_data:
        data_axis = getattr(distribution, "batch_dim_name", None)
        if data_axis not in sizes:
            raise ValueError(
                "LeanOptimizer(shard_over_data=True) needs a distribution with a "
                f"data-parallel axis; got {type(distribution).__name__} with mesh axes "
                f"{list(mesh.axis_names)} and batch_dim_name={data_axis!r}."
            )
        if any(data_axis in _names(a) for a in axes):
            data_axis = None  # the weight itself is split over it already
        else:
            parts = sizes[data_axis]
    return Placement(mesh, axes, shards, data_axis, parts)


def state_layout(place: Placement, shape):
    """The `TensorLayout` of a weight-shaped state variable (compensation, float moments):
    the weight's, split over the data axis too on the first dimension that divides evenly
    (replicated over it when none does). None without a distribution."""
    if place.mesh is None:
        return None
    axes = list(place.axes)
    if place.data_axis is not None:
        for i, (d, n) in enumerate(zip(shape, place.shards)):
            if (int(d) // n) % place.data_parts == 0:
                axes[i] = _merge(_names(axes[i]) + (place.data_axis,))
                break
    return _layout(tuple(axes), place.mesh)


def blocks(place: Placement, shape, block: int) -> lean_codecs.Blocks:
    """The 8-bit moment blocks of a weight placed as `place`: none straddles two shards,
    and each shard's blocks split evenly over the data axis."""
    return lean_codecs.blocks_for(shape, block, place.shards, place.data_parts)


def codes_layouts(place: Placement) -> tuple:
    """`(codes_layout, scales_layout)` of an 8-bit moment: its blocks (rows) split like the
    shards they belong to, then over the data axis. `(None, None)` without a distribution."""
    if place.mesh is None:
        return None, None
    names = ()
    for a in place.axes:
        names += _names(a)
    if place.data_axis is not None:
        names += (place.data_axis,)
    rows = _merge(names)
    return _layout((rows, None), place.mesh), _layout((rows,), place.mesh)


def per_device_bytes(variables) -> dict:
    """The bytes each device holds of `variables` (their addressable shards).

    Args:
        variables: Keras variables.

    Returns:
        `{device: bytes}`; on a backend without device placement of shards (TensorFlow),
        `{"all": total bytes}`.
    """

    out: dict = {}
    for variable in variables:
        value = variable.value
        shards = getattr(value, "addressable_shards", None)
        if shards is None:
            out["all"] = out.get("all", 0) + variable_bytes(variable)
            continue
        for shard in shards:
            out[shard.device] = out.get(shard.device, 0) + int(shard.data.nbytes)
    return out


def variable_bytes(variable) -> int:
    """Bytes of one variable's values (bfloat16: 2 a value)."""
    dtype = keras.backend.standardize_dtype(variable.dtype)
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    return math.prod(variable.shape) * itemsize
