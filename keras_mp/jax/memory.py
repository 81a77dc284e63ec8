"""The memory of a compiled train step, without running it (JAX backend).

XLA's buffer assignment is fixed at compile time: `jax.jit(...).lower(...).compile()` on
abstract arguments (`jax.ShapeDtypeStruct`s) says how many bytes the step's arguments,
temporaries and outputs take, and allocates none of them. `step_memory` compiles one
`model.train_step` that way, its state donated as `model.fit` donates it; `abstract_copy`
rebuilds a model from its config with no weight materialised (Keras' `StatelessScope`
without initialisation: shapes and dtypes only); `compile_device` gives the device to
compile for: the local one, or an XLA:GPU device description (a `GpuTargetConfig` .txtpb,
e.g. `benchmarks/h200.txtpb`) compiled for without a GPU (needs JAX's CUDA plugin,
`pip install "jax[cuda12]"`; no driver, no GPU).

A GPU's number is its buffer assignment (the runtime adds cuDNN/cuBLAS workspaces and the
allocator's rounding: about 1-2 GiB on an H200, benchmarks/BENCHMARKS.md section 9); a CPU's
is XLA:CPU's, which fuses less than XLA:GPU: an estimate.

Example:

```python
from keras_mp.jax.memory import compile_device, step_memory

device = compile_device()          # or compile_device("benchmarks/h200.txtpb")
step_memory(model, x, y, device)["peak_bytes"]
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

__all__ = ["CompileDevice", "abstract_copy", "compile_device", "step_memory", "unmaterialised"]


@dataclasses.dataclass(frozen=True)
class CompileDevice:
    """A device a train step is compiled for.

    Attributes:
        device: the `jax.Device` (a compile-only one for a device description).
        name: what it is, in words.
        memory_bytes: the memory a step may use: a GPU allocator's limit, the description's
            device memory, or the host's physical memory for a CPU.
        exact: True for XLA:GPU (the buffer assignment the GPU runs), False for XLA:CPU.
        compile_only: True when compiled from a device description, without the device.
    """

    device: object
    name: str
    memory_bytes: int
    exact: bool
    compile_only: bool


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _description_memory(text: str) -> int:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "device_memory_size":
            return int(value.strip())
    return 0


def compile_device(device=None) -> CompileDevice:
    """The device to compile for.

    Args:
        device: None (JAX's first local device), a `jax.Device`, or the path of an XLA:GPU
            device description (`GpuTargetConfig` text proto, e.g. `benchmarks/h200.txtpb`):
            compiled for without the GPU (needs JAX's CUDA plugin).

    Returns:
        A `CompileDevice`.

    Raises:
        FileNotFoundError: for a description path that does not exist.
        ValueError: when this JAX cannot compile for XLA:GPU (the plugin is missing).
    """
    import jax

    if device is None or isinstance(device, jax.Device):
        device = device or jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        memory = int((stats or {}).get("bytes_limit", 0)) or _host_memory()
        gpu = device.platform in ("gpu", "cuda", "rocm")
        return CompileDevice(device, str(device.device_kind), memory, gpu, False)
    path = os.fspath(device)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"device: no such XLA:GPU device description {path!r} (a GpuTargetConfig .txtpb, "
            "e.g. benchmarks/h200.txtpb)"
        )
    with open(path) as f:
        text = f.read()
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="", topology="1x1x1", target_config=text
        )
    except Exception as error:  # JaxRuntimeError, NotImplementedError, RuntimeError...
        raise ValueError(
            f"device={path!r}: this JAX cannot compile for XLA:GPU ({error}). It needs the "
            f"plugin (pip install 'jax[cuda12]=={jax.__version__}'; no GPU needed) and, on a "
            "machine without a GPU, JAX_PLATFORMS=cpu set before JAX starts."
        ) from error
    target = topology.devices[0]
    name = f"{os.path.basename(path)} (compile only: {target.device_kind})"
    return CompileDevice(target, name, _description_memory(text), True, True)


def _forget_uninitialised() -> None:
    """Keras initialises the variables a `StatelessScope` left uninitialised when the next
    outermost scope closes (`train_step` opens one); abstract ones must stay so."""
    from keras_mp.keras_glue.keras_internals import global_state

    global_state.set_global_attribute("uninitialized_variables", [])


@contextlib.contextmanager
def unmaterialised():
    """A scope whose new Keras variables get a shape and a dtype, and no value."""
    from keras_mp.keras_glue.keras_internals import StatelessScope

    try:
        with StatelessScope(initialize_variables=False):
            yield
    finally:
        _forget_uninitialised()


def abstract_copy(model):
    """`model` rebuilt from its config with no weight materialised (each layer keeps the
    `keras.RematScope` it was made under), or None when its config cannot rebuild it (a
    subclassed model without `get_config`)."""
    try:
        config = model.get_config()
        with unmaterialised():
            copy = model.__class__.from_config(config)
            if not copy.built:
                return None
    except Exception:  # NotImplementedError, TypeError...: no rebuildable config
        return None
    # A layer takes its RematScope when it is made: give the copy the original's.
    modes = {x.path: getattr(x, "_remat_mode", None) for x in model._flatten_layers()}
    for layer in copy._flatten_layers():
        if modes.get(layer.path) is not None:
            layer._remat_mode = modes[layer.path]
    return copy


@contextlib.contextmanager
def _flash_attention_as(answer: bool):
    """Keras asks the local GPU whether cuDNN flash attention runs; compiled for a GPU
    without one, answer as that GPU would (compute capability >= 8.0, cuDNN 9)."""
    from keras_mp.keras_glue.keras_internals import jax_nn as _jax_nn

    jax_nn = _jax_nn()

    saved = jax_nn._can_use_flash_attention

    def as_the_gpu(query, *args, raise_error=False, **kwargs):
        return str(query.dtype) in ("float16", "bfloat16")  # cuDNN's flash dtypes

    if answer:
        jax_nn._can_use_flash_attention = as_the_gpu
    try:
        yield
    finally:
        jax_nn._can_use_flash_attention = saved


def _nbytes(struct) -> int:
    import numpy as np

    size = 1
    for d in struct.shape:
        size *= int(d)
    return size * np.dtype(struct.dtype).itemsize


def step_memory(model, x, y, target: CompileDevice) -> dict:
    """Compiles (does not run) one `model.train_step` on `(x, y)` for `target`.

    Args:
        model: a compiled Keras model (optimizer and loss) whose optimizer is built;
            variables may be unmaterialised (`abstract_copy`, `unmaterialised`).
        x, y: the batch, or anything with `shape` and `dtype` (nested as the model takes).
        target: a `CompileDevice`.

    Returns:
        A dict of bytes: `peak_bytes` (arguments + temporaries + outputs not aliased to the
        donated arguments), `argument_bytes`, `temp_bytes`, `output_bytes`, `alias_bytes`,
        `weights_bytes` (model variables), `optimizer_bytes` (optimizer variables).
    """
    import jax

    sharding = jax.sharding.SingleDeviceSharding(target.device)

    def abstract(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype, sharding=sharding), tree
        )

    def specs(variables):
        return [jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=sharding) for v in variables]

    state = (
        specs(model.trainable_variables),
        specs(model.non_trainable_variables),
        specs(model.optimizer.variables),
        specs(model.metrics_variables),
    )
    data = (abstract(x), abstract(y), None)
    with _flash_attention_as(target.compile_only):
        lowered = jax.jit(model.train_step, donate_argnums=0).lower(state, data)
    _forget_uninitialised()
    memory = lowered.compile().memory_analysis()
    peak = (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )
    return {
        "peak_bytes": int(peak),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "weights_bytes": sum(map(_nbytes, state[0] + state[1])),
        "optimizer_bytes": sum(map(_nbytes, state[2])),
    }
