"""Compile-only memory and FLOP analysis of train steps (JAX backend, any device, no run).

XLA's buffer assignment is deterministic: it says how many bytes of temporaries a compiled
step needs, without allocating or running anything, so it can compare recipes at the GPU
sizes of issue 8 on a CPU. It prints one JSON line per configuration:

- `step`: the whole `model.train_step` (weights, optimizer slots and batch as abstract
  arguments, buffers donated as `model.fit` does) of a workload under a harness policy.
  With each record, the kernels of the compiled step and the bytes they move
  (`benchmarks/hlo_traffic.py`).
- `logits`: only the vocabulary projection plus the loss and their gradients, for the
  GPT workload: `stock` (bfloat16 Dense + Keras' loss, which up-casts the logits), `fp32_head`
  (the "usual advice": the projection in float32, then Keras' loss) and `keras_mp`
  (bfloat16 projection + `kmp.losses.SparseCategoricalCrossentropy`, fused).

Numbers are the compiling backend's: XLA:CPU materialises some tensors that XLA:GPU fuses
and schedules differently, so its bytes differ from a GPU's. `--target h200` compiles for an
H200 without one: XLA:GPU's own compiler (the `jax[cuda12]` plugin must be installed; no
GPU, driver or autotuning needed) given the device description `benchmarks/h200.txtpb`.
That is the buffer assignment the GPU would run, and `peak_estimate_gib` (arguments +
temporaries + outputs not aliased to arguments) is what it allocates for the step; the
runtime adds cuDNN workspaces, the batch, and the allocator's rounding. Keras decides flash
attention by querying the local GPU; compiled without one, the script answers as an H200
would (`--flash on`, the default with a target: cuDNN 9 on compute capability 9.0).
A policy may carry the harness' `@remat` (XLA's rematerialization pass given a memory
limit, `keras_mp.cli.measure.REMAT_XLA_FLAG`, as this compile's options; XLA:GPU only).

    KERAS_BACKEND=jax python benchmarks/xla_memory.py --models gpt \
        --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16 --logits
    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    python benchmarks/xla_memory.py --target h200 --models gpt \
        --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from hlo_traffic import KINDS, dot_flops, kernel_traffic  # noqa: E402

GIB = 2**30
TARGETS = {"h200": os.path.join(HERE, "h200.txtpb")}


def target_sharding(target: str):
    """A compile-only device of an XLA:GPU `target` (a name in `TARGETS` or a .txtpb path)."""
    import jax
    from jax.experimental import topologies

    path = TARGETS.get(target, target)
    with open(path) as f:
        config = f.read()
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="", topology="1x1x1", target_config=config
        )
    except Exception as error:  # jax.errors.JaxRuntimeError, NotImplementedError, ...
        raise SystemExit(
            f"--target {target}: cannot compile for XLA:GPU here ({error}); install the "
            f"plugin: pip install 'jax[cuda12]=={jax.__version__}'"
        ) from error
    return jax.sharding.SingleDeviceSharding(topology.devices[0])


def _answer_flash_attention_as_a_gpu() -> None:
    """Keras' JAX backend enables cuDNN flash attention where the local GPU supports it;
    with no local GPU, answer for the target (compute capability >= 8.0, cuDNN >= 9)."""
    from keras_mp.keras_glue.keras_internals import jax_nn as _jax_nn

    jax_nn = _jax_nn()

    jax_nn._can_use_flash_attention = lambda *args, raise_error=False, **kwargs: True


def _abstract(tree, sharding):
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _analysis(compiled) -> dict:
    text = compiled.as_text()
    traffic = kernel_traffic(text)
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    peak = (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )
    return {
        "peak_estimate_gib": round(peak / GIB, 3),
        "temp_gib": round(memory.temp_size_in_bytes / GIB, 3),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "xla_flops": float(cost["flops"]) if "flops" in cost else None,  # None: XLA:GPU
        "dot_flops": dot_flops(text),  # the optimised module's matmuls (recomputation too)
        "flash_attention_calls": text.count("__cudnn$fmha"),
        # Kernels and GiB each reads + writes (benchmarks/hlo_traffic.py): element-wise
        # work runs at memory speed on a GPU, so `traffic_gib["other"]` / bandwidth
        # bounds its time from below.
        "kernels": {kind: traffic[kind]["kernels"] for kind in KINDS},
        "traffic_gib": {kind: traffic[kind]["gib"] for kind in KINDS},
        "copies": traffic["copies"],
        "conditionals": traffic["conditionals"],
        # the element-wise kernels by the layer (forward / backward), update or check
        # that made them (benchmarks/hlo_traffic.py `origin`)
        "other_by_origin": traffic["other_by_origin"],
    }


REMAT_SLOP = None  # --remat-slop: the `@remat` memory limit's share of the GPU (percent)


def _remat_options() -> dict:
    """The harness' `@remat` flag (`keras_mp.cli.measure.REMAT_XLA_FLAG`) as compiler options
    (its share of the GPU's memory replaced by `--remat-slop`, if given)."""
    from keras_mp.cli.measure import REMAT_XLA_FLAG

    name, _, value = REMAT_XLA_FLAG.lstrip("-").partition("=")
    return {name: int(value if REMAT_SLOP is None else REMAT_SLOP)}


def hlo_flops(lowered):
    """XLA's cost analysis of the lowered, unoptimised step: the FLOPs the program asks
    for, rematerialised forward passes included (cuDNN attention calls count 0), by the
    CPU client where the target's compile-only client has none."""
    try:
        cost = lowered.cost_analysis()
    except NotImplementedError:
        cost = None
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    if "flops" not in cost:
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        module = lowered._lowering.hlo().as_hlo_module()
        cost = _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), module) or {}
    return float(cost["flops"]) if "flops" in cost else None


def step_record(
    model_name: str,
    policy: str,
    keep_fp32=None,
    sharding=None,
    remat_layers=(),
    recompute: bool = False,
) -> dict:
    """Compiles (does not run) one train step of `model_name` under a harness `policy`
    (for the device of `sharding`; default: the local one). `policy@remat` compiles it with
    the harness' `@remat` memory limit (XLA's rematerialization; XLA:GPU only);
    `remat_layers` (layer-name prefixes) builds the model under Keras' `RematScope`
    naming those layers of each block (`remat_scope`); `recompute` applies
    `kmp.recompute_elementwise` (matmul and attention outputs saved, the rest recomputed)."""
    import jax
    import numpy as np

    from keras_mp.cli.measure import POLICIES, _compiled_model, _names, remat_scope
    from keras_mp.cli.workloads import WORKLOADS

    _names("policy", policy, POLICIES)
    base, _, suffix = policy.partition("@")
    options = _remat_options() if suffix == "remat" else None

    workload = WORKLOADS[model_name]
    start = time.perf_counter()
    with remat_scope(workload, remat_layers):
        model = _compiled_model(workload, base, True, keep_fp32)
    if recompute:
        from keras_mp.memory.recompute import recompute_elementwise

        recompute_elementwise(model)
    x, y = workload.data(np.random.default_rng(0))
    model._symbolic_build(data_batch=(x[:1], y[:1], None))
    model.optimizer.build(model.trainable_variables)
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    abstract = _abstract(state, sharding)
    data = (*_abstract((x, y), sharding), None)
    lowered = jax.jit(model.train_step, donate_argnums=0).lower(abstract, data)
    flops = hlo_flops(lowered)
    compiled = lowered.compile(compiler_options=options)
    return {
        "kind": "step",
        "model": model_name,
        "policy": base,
        "xla_options": options,
        "remat_layers": list(remat_layers) or None,
        "recompute_elementwise": recompute,
        "hlo_flops": flops,
        "keep_fp32": None if keep_fp32 is None else list(keep_fp32),
        **_analysis(compiled),
        "compile_s": round(time.perf_counter() - start, 1),
    }


def logits_records(model_name: str = "gpt", sharding=None) -> list:
    """The vocabulary projection + loss + gradients of a GPT workload, three recipes."""
    import jax
    import jax.numpy as jnp
    import keras

    from keras_mp import losses
    from keras_mp.cli.workloads import WORKLOADS

    gpt = WORKLOADS[model_name]
    tokens, d, vocab = gpt.units_per_step, gpt.d_model, gpt.vocab
    stock_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours_loss = losses.SparseCategoricalCrossentropy(from_logits=True)

    def recipe(head_dtype, loss):
        def f(h, w, y):
            z = jnp.dot(h.astype(head_dtype), w.astype(head_dtype))
            return loss(y, z)

        return f

    recipes = {
        "stock": recipe(jnp.bfloat16, stock_loss),
        "fp32_head": recipe(jnp.float32, stock_loss),
        "keras_mp": recipe(jnp.bfloat16, ours_loss),
    }
    args = (
        jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((d, vocab), jnp.float32, sharding=sharding),
        jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding),
    )
    records = []
    for name, f in recipes.items():
        grad = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        records.append(
            {
                "kind": "logits",
                "model": model_name,
                "recipe": name,
                "logits_shape": [tokens, vocab],
                **_analysis(grad.lower(*args).compile()),
            }
        )
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt")
    parser.add_argument(
        "--policies", default="float32,stock_mixed_bfloat16,keras_mp_mixed_bfloat16"
    )
    parser.add_argument("--keep-fp32", default=None, help="comma-separated keep-list override")
    parser.add_argument(
        "--remat-layers",
        default="",
        help="comma-separated layer-name prefixes built under keras.RematScope("
        "mode='list_of_layers') in each block, e.g. attn_,ffn_in_ (GPT workloads)",
    )
    parser.add_argument(
        "--remat-slop",
        type=int,
        default=None,
        help="the @remat rows' memory limit, percent of the GPU's memory (default: the harness' 5)",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="kmp.recompute_elementwise: save matmul and attention outputs, recompute the rest",
    )
    parser.add_argument("--logits", action="store_true", help="also the logits-region records")
    parser.add_argument("--no-steps", action="store_true", help="only the logits records")
    parser.add_argument("--out", default=None, help="append JSON lines to this file")
    parser.add_argument(
        "--target",
        default=None,
        help="compile for this GPU instead of the local device: h200 or a GpuTargetConfig "
        ".txtpb (needs the jax[cuda12] plugin, no GPU)",
    )
    parser.add_argument(
        "--flash",
        choices=("auto", "on"),
        default=None,
        help="Keras' flash-attention check: auto (ask the local device) or on (as a GPU "
        "with cuDNN 9 would answer); default: on with --target, else auto",
    )
    args = parser.parse_args(argv)
    if args.target:
        os.environ["JAX_PLATFORMS"] = "cpu"  # the host runs Keras; XLA:GPU only compiles
    import jax
    import keras

    if keras.backend.backend() != "jax":
        print("xla_memory.py needs KERAS_BACKEND=jax", file=sys.stderr)
        return 2
    sharding = target_sharding(args.target) if args.target else None
    flash = args.flash or ("on" if args.target else "auto")
    if flash == "on":
        _answer_flash_attention_as_a_gpu()
    keep = None if args.keep_fp32 is None else tuple(args.keep_fp32.split(","))
    remat = tuple(p for p in args.remat_layers.split(",") if p)
    global REMAT_SLOP
    REMAT_SLOP = args.remat_slop
    records = []
    for model_name in args.models.split(","):
        if args.logits and model_name.endswith("gpt"):
            records += logits_records(model_name, sharding)
        if not args.no_steps:
            records += [
                step_record(model_name, p, keep, sharding, remat, args.recompute)
                for p in args.policies.split(",")
            ]
    if sharding is not None:
        device = f"{args.target} (compile only: {sharding.device_set.pop().device_kind})"
    else:
        device = str(jax.devices()[0].device_kind)
    from keras_mp.cli.records import emit

    for record in records:
        record.update(device=device, flash=flash, jax=jax.__version__, keras=keras.__version__)
        emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
