"""Compile-only per-device memory of a full fine-tune of a Gemma-2B-sized keras_hub model
(issue 32.5, keras-hub#1628), on one device or several, for an H200 or the local device.

`keras_hub.models.GemmaCausalLM` on a `GemmaBackbone` built from explicit kwargs (Gemma-2B:
2,506,172,416 parameters, the figure of keras_hub's `gemma_2b_en` preset; no preset is
downloaded), random init, sequence 1024, AdamW, loss on the tied-embedding logits: one
`model.train_step` compiled (not run) as `benchmarks/xla_memory.py` does, with weights,
optimizer state and batch as abstract arguments (buffers donated as `model.fit` does).

No weight is materialised: the model and the optimizer are built inside a Keras
`StatelessScope`, where variables with an initializer stay uninitialised (shape, dtype and
layout only); the arguments are `jax.ShapeDtypeStruct`s carrying each variable's sharding.
keras_mp's policies come from `kmp.convert` run on a twin with the same layers at tiny
sizes (a real, small model): its `DTypePolicyMap` (the config) and its variables' dtypes
(lean's bfloat16 trainable weights) are given to the full-size model by variable path.

Devices: `--devices 1` compiles for one device; `--devices N` for N compile-only devices
of the target (XLA:GPU: `get_topology_desc(topology="1x1xN")`), under the `--mesh`:
- `model`: `keras.distribution.ModelParallel`, mesh (batch=1, model=N), keras_hub's
  `GemmaBackbone.get_layout_map` (what keras-hub#1628 ran, there on 4 GPUs), batch 1. As
  keras_hub writes it the map splits the single key/value head over "model", which cannot
  be (IndivisibleError; `--layout-map keras_hub` records it): by default those two kernels
  are replicated over "model" (`--layout-map kv_replicated`).
- `data`: `keras.distribution.DataParallel` over N (weights replicated), batch N (one
  sequence per device); with `lean_split` the lean state is split over the N devices.
- `BxM` (e.g. `2x4`): ModelParallel on a (batch=B, model=M) mesh, batch B.
`memory_analysis()` of an SPMD program is per device. Policies: `stock_mixed_bfloat16`
(Keras' policy, keras.optimizers.AdamW), `keras_mp_mixed_bfloat16`, `lean` (`lean_bfloat16`,
`kmp.LeanOptimizer(AdamW)`), `lean_split` (the same with `shard_over_data=True`). A
`@remat` suffix builds the model under `keras.RematScope(mode="list_of_layers")` naming the
decoder blocks (each block's forward recomputed in the backward pass); the record's
`hlo_flops` (XLA's cost analysis of the lowered, unoptimised HLO) counts the recomputation.

    pip install "jax[cuda12]==0.10.2"   # in a venv of its own; compile only, no GPU needed
    PYTHONPATH=. python benchmarks/gemma_memory.py --target h200 --devices 1 \
        --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16,lean,lean@remat
    PYTHONPATH=. python benchmarks/gemma_memory.py --target h200 --devices 8 --mesh model \
        --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16,lean
    PYTHONPATH=. python benchmarks/gemma_memory.py --target h200 --devices 8 --mesh data \
        --policies lean,lean_split

(BENCHMARKS.md section 13 has every command and the table.)

`--model llama3_8b` (BENCHMARKS.md, "8B full fine-tune, per device") does the same for
`keras_hub.models.Llama3CausalLM` on a `Llama3Backbone` of Llama-3-8B's shapes
(8,030,261,248 parameters, sequence 2048; RematScope names its `transformer_layer_*`
blocks), `--model gemma7b` for Gemma-7B's (sequence 2048); `--peak-buffers` adds what is
live at the peak, by kind (`peak_memory.py`: weight gradients held for the update,
activations saved for the backward pass, ...).

Suffixes `@fused` (issue 54's lever 3: `keras_mp.numerics.fused_lm_loss.use_fused_loss`,
the loss from the hidden states without the full logits) and `@chunked` (lever 2: the
lean update of large matrices in row blocks, `keras_mp.lean.chunked`; keras_mp's default,
turned off with `KERAS_MP_LEAN_CHUNK=0` in every row without it) combine with `+`:
`lean@fused+chunked`, `lean@remat+fused+chunked`. Lever 4 (BENCHMARKS.md section 24):
`@recompute` (`kmp.recompute_elementwise`), `@blocks` (`kmp.recompute_blocks`: the same
step as `@remat`, applied to the built model), `@blocks_matmuls` (`save="matmuls"`).
`--batch N` compiles N sequences a step on one device.
`@backward` (lever 1: each weight's lean update inside the backward pass,
`keras_mp.lean.in_backward`): `lean@fused+chunked+backward`.

`--tiny` builds a small model (vocabulary 512, 2 layers) to check the pipeline in seconds.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import NamedTuple

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GIB = 2**30
SEQUENCE = 1024  # Gemma-2B's (section 13); each model's own below

GEMMA_2B_PARAMS = 2506172416  # keras_hub's gemma_2b_en (the preset's own config is on Kaggle)


class ModelSpec(NamedTuple):
    """One `--model`: its keras_hub classes, its full-size kwargs, the kwargs of its tiny
    twin (the same layers at small sizes: `--tiny`, and the twin `kmp.convert` runs on),
    its sequence length and the name prefix of its decoder blocks (for RematScope)."""

    backbone: str
    task: str
    full: dict
    tiny: dict
    sequence: int
    block: str


# The one table of model specs: each --model's keras_hub classes, decoder block prefix and
# sequence, and its backbone kwargs full-size and for its tiny twin (None: not passed).
# Parameters: Gemma-2B 2,506,172,416 (gemma_2b_en), Gemma-7B 8,537,680,896 (gemma_7b_en),
# Llama-3-8B 8,030,261,248 (llama3_8b_en, untied output embedding).
_KWARGS = (
    "vocabulary_size", "num_layers", "num_query_heads", "num_key_value_heads", "hidden_dim",
    "intermediate_dim", "head_dim", "rope_max_wavelength",
)  # fmt: skip
# fmt: off
_TABLE = {
    #             backbone, task, decoder block prefix, sequence; then the kwargs' rows:
    #             vocab   layers  q   kv  hidden  inter  head  rope
    "gemma2b": (
        "GemmaBackbone", "GemmaCausalLM", "decoder_block_", SEQUENCE,
        (256000,  18,      8,  1,  2048,  32768,  256,  None),  # full size
        (512,      2,      8,  1,    64,    256,   16,  None),  # tiny twin
    ),
    "gemma7b": (
        "GemmaBackbone", "GemmaCausalLM", "decoder_block_", 2048,
        (256000,  28,     16, 16,  3072,  49152,  256,  None),
        (512,      2,      8,  1,    64,    256,   16,  None),
    ),
    "llama3_8b": (
        "Llama3Backbone", "Llama3CausalLM", "transformer_layer_", 2048,
        (128256,  32,     32,  8,  4096,  14336, None, 500000),
        (512,      2,      8,  2,    64,    256, None,  None),
    ),
}
# fmt: on


def _kwargs(row: tuple) -> dict:
    return {k: v for k, v in zip(_KWARGS, row) if v is not None}


MODELS = {
    name: ModelSpec(backbone, task, _kwargs(full), _kwargs(tiny), sequence, block)
    for name, (backbone, task, block, sequence, full, tiny) in _TABLE.items()
}
# policy suffixes (`lean@fused+chunked`): issue 54's levers
SUFFIXES = {
    "remat": "keras.RematScope(mode='list_of_layers') over the decoder blocks",
    "recompute": "kmp.recompute_elementwise (matmul and attention outputs saved)",
    "blocks": "kmp.recompute_blocks: each decoder block recomputed from its inputs",
    "blocks_matmuls": "kmp.recompute_blocks(save='matmuls'): per block, matmul outputs saved",
    "fused": "kmp.use_fused_loss (lever 3)",
    "chunked": "the lean update in row blocks (lever 2)",
    "backward": "each weight's lean update inside the backward pass (lever 1)",
}
POLICIES = {
    "stock_mixed_bfloat16": "mixed_bfloat16",
    "keras_mp_mixed_bfloat16": "mixed_bfloat16",
    "lean": "lean_bfloat16",
    "lean_split": "lean_bfloat16",
}


def devices_for(target, count: int) -> list:
    """`count` compile-only devices of an XLA:GPU target, or local devices."""
    import jax

    if target is None:
        devices = jax.devices()
        if len(devices) < count:
            raise SystemExit(
                f"--devices {count}: {len(devices)} local devices (for CPU set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={count})"
            )
        return devices[:count]
    from jax.experimental import topologies
    from xla_memory import TARGETS

    with open(TARGETS.get(target, target)) as f:
        config = f.read()
    topology = topologies.get_topology_desc(
        platform="cuda", topology_name="", topology=f"1x1x{count}", target_config=config
    )
    return list(topology.devices)[:count]


def distribution_for(
    mesh: str, devices: list, layout: str = "kv_replicated", model: str = "gemma2b"
):
    """`(distribution, batch)`: a keras.distribution over `devices` and the global batch."""
    import keras
    import keras_hub

    n = len(devices)
    if n == 1 and mesh in ("none", None):
        return None, 1
    if mesh == "data":
        dmesh = keras.distribution.DeviceMesh((n,), ["batch"], devices)
        return keras.distribution.DataParallel(device_mesh=dmesh), n
    b, m = (1, n) if mesh == "model" else map(int, mesh.split("x"))
    if b * m != n:
        raise SystemExit(f"--mesh {mesh}: {b * m} devices, not {n}")
    dmesh = keras.distribution.DeviceMesh((b, m), ["batch", "model"], devices)
    backbone = MODELS[model].backbone
    kwargs = MODELS[model].full
    layout_map = getattr(keras_hub.models, backbone).get_layout_map(dmesh)
    if layout == "kv_replicated" and kwargs["num_key_value_heads"] % m:
        # Gemma-2B has one key/value head: keras_hub's map splits the kernels' head axis
        # (size 1) over "model", which no sharding can do (IndivisibleError). Keep the
        # query's layout; the key/value kernels are split over "batch" on the hidden axis
        # and replicated over "model" (as tensor parallelism does with multi-query heads).
        query_key = "decoder_block.*attention.*(query|key|value).kernel"
        del layout_map[query_key]
        layout_map["decoder_block.*attention.*query.kernel"] = ("model", "batch", None)
        layout_map["decoder_block.*attention.*(key|value).kernel"] = (None, "batch", None)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"), b


def _causal_lm(keras_hub, kwargs, dtype=None, model: str = "gemma2b"):
    backbone, task = MODELS[model].backbone, MODELS[model].task
    backbone = getattr(keras_hub.models, backbone)(**kwargs, dtype=dtype)
    return getattr(keras_hub.models, task)(backbone=backbone, preprocessor=None)


def keras_mp_plan(dtype: str, num_layers: int, model: str = "gemma2b") -> tuple:
    """`(causal_lm_config, {variable path: dtype})` of `kmp.convert(model, dtype)` for a
    twin of `model` with `num_layers` decoder blocks at tiny sizes (built for real)."""
    import keras
    import keras_hub

    import keras_mp as kmp

    keras.config.set_dtype_policy("float32")
    twin_kwargs = dict(MODELS[model].tiny, num_layers=num_layers)
    twin = _causal_lm(keras_hub, twin_kwargs, model=model)
    converted = kmp.convert(twin, kmp.Policy(dtype), check=None)
    dtypes = {v.path: v.dtype for v in converted.variables}
    return converted.get_config(), dtypes


def _record_name(model: str, kwargs: dict) -> str:
    if kwargs == MODELS[model].full:
        return {"gemma2b": "gemma_2b", "gemma7b": "gemma_7b"}.get(model, model)
    return "gemma_tiny" if model == "gemma2b" else f"{model}_tiny"


def _forget_uninitialised() -> None:
    """Keras initialises the variables a `StatelessScope` left uninitialised when the next
    outermost one closes (`model.train_step` opens one): it must not, they are abstract."""
    from keras_mp.keras_glue.keras_internals import global_state

    global_state.set_global_attribute("uninitialized_variables", [])


class _entered:
    """Enters several context managers, leaves them in reverse order."""

    def __init__(self, scopes):
        self.scopes = scopes

    def __enter__(self):
        for scope in self.scopes:
            scope.__enter__()

    def __exit__(self, *exc):
        for scope in reversed(self.scopes):
            scope.__exit__(*exc)


def build(policy: str, kwargs: dict, distribution, remat: bool, model_name: str = "gemma2b"):
    """The compiled (Keras `compile`, not XLA) model and built optimizer, all variables
    unmaterialised. Returns `(model, forced)`: `forced` counts variables whose dtype was
    set from the keras_mp twin's."""
    import keras
    import keras_hub

    import keras_mp as kmp
    from keras_mp.keras_glue.keras_internals import StatelessScope

    dtype = POLICIES[policy]
    stock = policy.startswith("stock_")
    num_layers = kwargs["num_layers"]
    config, dtypes = (None, {}) if stock else keras_mp_plan(dtype, num_layers, model_name)
    keras.config.set_dtype_policy(dtype if stock else "float32")
    keras.utils.set_random_seed(0)

    def scopes(with_remat=True):
        found = [] if distribution is None else [distribution.scope()]
        if remat and with_remat:
            names = [f"{MODELS[model_name].block}{i}" for i in range(num_layers)]
            found.append(keras.RematScope(mode="list_of_layers", layer_names=names))
        return found

    # Optimizers and Keras' compile create small variables with values (the step counter,
    # the learning rate, the loss tracker): made outside the scopes, on the host, and
    # given as replicated arguments. Tasks compile themselves in __init__: held off.
    adamw = keras.optimizers.AdamW(1e-5)
    if dtype == "lean_bfloat16":
        optimizer = kmp.LeanOptimizer(adamw, shard_over_data=policy == "lean_split")
    else:
        optimizer = adamw
    if stock:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        loss = kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    forced = 0
    task = getattr(keras_hub.models, MODELS[model_name].task)
    compile_method = task.compile
    with StatelessScope(initialize_variables=False), _entered(scopes()):
        task.compile = lambda self, *args, **kwargs: None
        try:
            if stock:
                model = _causal_lm(keras_hub, kwargs, model=model_name)
            else:
                config["backbone"]["config"].update(kwargs)
                model = task.from_config(config)
        finally:
            task.compile = compile_method
    _forget_uninitialised()
    with _entered(scopes()):
        for v in model.variables:
            want = dtypes.get(v.path)
            if not stock and want is None:
                raise RuntimeError(f"no twin variable for {v.path}")
            if not stock and v.dtype != want:
                v._dtype = want  # unmaterialised: the dtype is only metadata
                forced += 1
            v._initialize_layout()
    if remat:
        # Keras' RematScope hands `training=True` to jax.checkpoint, which traces it, and
        # keras.layers.Dropout branches on it in Python (`if training and ...`): Llama's
        # blocks call their rate-0 dropouts unconditionally. Those are the identity.
        for layer in model._flatten_layers():
            if isinstance(layer, keras.layers.Dropout) and layer.rate == 0:
                layer.call = lambda inputs, training=None: inputs
    # Stock: Keras' compile as it is (keras_mp, imported here, would wrap a
    # "mixed_bfloat16" model's optimizer in its skip-only LossScaleOptimizer).
    model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[], auto_scale_loss=not stock)
    with StatelessScope(initialize_variables=False), _entered(scopes(with_remat=False)):
        model.optimizer.build(model.trainable_variables)
    _forget_uninitialised()
    return model, forced


def _model_parallel():
    import keras

    return keras.distribution.ModelParallel


def _sharding(variable, default):
    import keras

    layout = getattr(variable, "_layout", None)
    if layout is None:
        return default
    if isinstance(layout, keras.distribution.TensorLayout):
        return layout.backend_layout
    return layout


def _shard_bytes(struct) -> int:
    import numpy as np

    shape = struct.sharding.shard_shape(struct.shape)
    return math.prod(shape) * np.dtype(struct.dtype).itemsize


def step_record(
    policy: str,
    kwargs: dict,
    devices: list,
    mesh: str,
    layout: str,
    model_name: str = "gemma2b",
    sequence: int = SEQUENCE,
    peak_dir: str | None = None,
    batch_size: int | None = None,
) -> dict:
    import jax
    import jax.numpy as jnp
    from xla_memory import _analysis, hlo_flops

    base, _, suffix = policy.partition("@")
    if base not in POLICIES:
        raise SystemExit(f"unknown policy {base!r}; one of {sorted(POLICIES)}")
    levers = set(suffix.split("+")) if suffix else set()
    unknown = levers - set(SUFFIXES)
    if unknown:
        raise SystemExit(f"unknown policy suffix {sorted(unknown)}; one of {sorted(SUFFIXES)}")
    # issue 54's levers: lever 2 (the lean update in row blocks) is on by default in
    # keras_mp; the rows without `chunked` turn it off to show what it changes
    from keras_mp.lean import chunked

    os.environ[chunked.CHUNK_ENV] = "" if "chunked" in levers else "0"
    start = time.perf_counter()
    distribution, batch = distribution_for(mesh, devices, layout, model_name)
    model, forced = build(base, kwargs, distribution, "remat" in levers, model_name)
    if "fused" in levers:  # lever 3: the loss from the hidden states, chunked
        from keras_mp.numerics.fused_lm_loss import use_fused_loss

        use_fused_loss(model)
    if "recompute" in levers:  # lever 4: matmul outputs saved, the rest recomputed
        from keras_mp.memory.recompute import recompute_elementwise

        recompute_elementwise(model)
    for save in ("inputs", "matmuls"):  # lever 4, the library's way
        if ("blocks" if save == "inputs" else "blocks_matmuls") in levers:
            from keras_mp.memory.blocks import recompute_blocks

            recompute_blocks(model, save=save)
    if "backward" in levers:  # lever 1: each weight's lean update in the backward pass
        from keras_mp.lean import in_backward

        model.optimizer.update_in_backward = True  # the same state; only the step differs
        in_backward.check(model.optimizer)
        in_backward.attach(model)
    if distribution is None:
        batch = batch_size or batch
        default = jax.sharding.SingleDeviceSharding(devices[0])
        data_sharding = default
    else:
        backend_mesh = distribution.device_mesh.backend_mesh
        default = jax.sharding.NamedSharding(backend_mesh, jax.sharding.PartitionSpec())
        data_sharding = distribution.get_data_layout((batch, sequence)).backend_layout

    def abstract(variables):
        return [
            jax.ShapeDtypeStruct(tuple(v.shape), v.dtype, sharding=_sharding(v, default))
            for v in variables
        ]

    state = (
        abstract(model.trainable_variables),
        abstract(model.non_trainable_variables),
        abstract(model.optimizer.variables),
        abstract(model.metrics_variables),
    )
    tokens = jax.ShapeDtypeStruct((batch, sequence), jnp.int32, sharding=data_sharding)
    x = {"token_ids": tokens, "padding_mask": tokens}
    data = (x, tokens, None)
    weights = sum(_shard_bytes(s) for s in state[0] + state[1])
    optimizer_bytes = sum(_shard_bytes(s) for s in state[2])
    params = sum(math.prod(v.shape) for v in model.trainable_variables)
    # As Keras' trainer jits the step under a distribution: the new state keeps the
    # variables' shardings (out_shardings), so the donated buffers are reused.
    out_shardings = None
    if distribution is not None:
        out_shardings = (None, jax.tree.map(lambda s: s.sharding, state))
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=out_shardings)
    lowered = step.lower(state, data)
    flops = hlo_flops(lowered)
    compiled = lowered.compile()
    analysis = _analysis(compiled)
    record = {
        "kind": "gemma_step",
        "model": _record_name(model_name, kwargs),
        "backbone_kwargs": kwargs,
        "parameters": int(params),
        "sequence": sequence,
        "batch": batch,
        "policy": base,
        "remat": "RematScope(list_of_layers: decoder blocks)" if "remat" in levers else None,
        "recompute_elementwise": "recompute" in levers,
        "recompute_blocks": (
            "matmuls" if "blocks_matmuls" in levers else "inputs" if "blocks" in levers else None
        ),
        "fused_loss": "fused" in levers,
        "chunked_update": "chunked" in levers,
        "update_in_backward": "backward" in levers,
        "devices": len(devices),
        "mesh": mesh if distribution is not None else None,
        "distribution": type(distribution).__name__ if distribution is not None else None,
        "layout_map": layout if isinstance(distribution, _model_parallel()) else None,
        "optimizer": type(model.optimizer).__name__,
        "dtypes_set_from_twin": forced,
        "weights_gib_per_device": round(weights / GIB, 3),
        "optimizer_gib_per_device": round(optimizer_bytes / GIB, 3),
        "weights_and_state_gib_per_device": round((weights + optimizer_bytes) / GIB, 3),
        "hlo_flops": flops,
        **analysis,
        "compile_s": round(time.perf_counter() - start, 1),
    }
    if peak_dir is not None:
        from peak_memory import forward_level, peak_buffer_record, phase_peaks

        shapes = [s.sharding.shard_shape(s.shape) for s in state[0]]
        hlo_text = compiled.as_text()
        record.update(peak_buffer_record(peak_dir, shapes, hlo_text))
        record.update(phase_peaks(peak_dir, shapes, hlo_text))
        record["forward_level_gib"] = forward_level(peak_dir, shapes, hlo_text)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="stock_mixed_bfloat16,keras_mp_mixed_bfloat16,lean")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument(
        "--mesh", default=None, help="model (default with --devices > 1), data, BxM"
    )
    parser.add_argument(
        "--layout-map",
        choices=("kv_replicated", "keras_hub"),
        default="kv_replicated",
        help="ModelParallel: keras_hub's GemmaBackbone.get_layout_map as it is, or with the "
        "single key/value head's kernels replicated over 'model' (default)",
    )
    parser.add_argument("--target", default=None, help="h200 or a .txtpb (XLA:GPU, compile only)")
    parser.add_argument(
        "--flash",
        choices=("auto", "on", "off"),
        default=None,
        help="attention: on = as keras_hub and Keras decide on an H200 (cuDNN flash "
        "attention through ops.dot_product_attention; default with --target), off / auto = "
        "as they decide on this host (keras_hub's einsum attention on a CPU)",
    )
    parser.add_argument("--tiny", action="store_true", help="a small model, to check the pipeline")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="gemma2b",
        help="gemma2b (section 13), llama3_8b (Llama3Backbone, sequence 2048) or gemma7b",
    )
    parser.add_argument("--sequence", type=int, default=None, help="default: the model's")
    parser.add_argument(
        "--batch", type=int, default=None, help="sequences a step, one device (default 1)"
    )
    parser.add_argument(
        "--peak-buffers",
        action="store_true",
        help="also classify the buffers live at the peak (XLA's buffer assignment): "
        "gradient-shaped, weight-sized and other bytes (peak_memory.py)",
    )
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    args = parser.parse_args(argv)
    if args.target:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the host runs Keras; XLA:GPU only compiles
    if args.peak_buffers:
        from peak_memory import dump_buffer_assignments

        dump_dir = dump_buffer_assignments()
    import jax
    import keras
    from xla_memory import _answer_flash_attention_as_a_gpu

    if keras.backend.backend() != "jax":
        print("gemma_memory.py needs KERAS_BACKEND=jax", file=sys.stderr)
        return 2
    flash = args.flash or ("on" if args.target else "auto")
    if flash == "on":
        _answer_flash_attention_as_a_gpu()
        # keras_hub's Gemma attention takes the fused op only where jax.devices() has a GPU
        # (Llama's takes it wherever JAX has jax.nn.dot_product_attention)
        from keras_hub.src.models.gemma import gemma_attention

        gemma_attention.running_on_gpu = lambda: True
    mesh = args.mesh or ("model" if args.devices > 1 else "none")
    devices = devices_for(args.target, args.devices)
    spec = MODELS[args.model]
    kwargs = spec.tiny if args.tiny else spec.full
    sequence = args.sequence or spec.sequence
    status = 0
    from keras_mp.cli.records import emit

    for policy in args.policies.split(","):
        try:
            record = step_record(
                policy,
                kwargs,
                devices,
                mesh,
                args.layout_map,
                args.model,
                sequence,
                dump_dir if args.peak_buffers else None,
                args.batch,
            )

        except Exception as error:  # a failed configuration is recorded, with why
            status = 1
            record = {
                "kind": "gemma_step",
                "policy": policy,
                "devices": args.devices,
                "mesh": mesh,
                "layout_map": args.layout_map if args.devices > 1 else None,
                "model": _record_name(args.model, kwargs),
                "error": f"{type(error).__name__}: {error}"[:2000],
            }
        record.update(
            device=(
                f"{args.target} (compile only: {devices[0].device_kind})"
                if args.target
                else str(devices[0].device_kind)
            ),
            flash=flash,
            jax=jax.__version__,
            keras=keras.__version__,
        )
        emit(record, args.out)
    return status


if __name__ == "__main__":
    sys.exit(main())
