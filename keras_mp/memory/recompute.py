"""Recompute the cheap work in the backward pass, keep the matmuls' outputs.

Activations saved for the backward pass are most of a transformer step's peak. Keras'
`RematScope` recomputes whole layers, matmuls included (+8-15% of the step's FLOPs for a
GPT, BENCHMARKS 14.2). `recompute_elementwise(model)` cuts the model's graph into stretches
(a transformer: at each residual add) and runs each under `jax.checkpoint` with a policy
that saves only what a matmul, a convolution or a fused attention kernel produced: layer
norms, activations, residual adds, casts, dropout masks and softmaxes are recomputed from
those in the backward pass, stretch by stretch, where they cost memory bandwidth, not FLOPs
(JAX's `checkpoint_dots` policy, with attention kept). One checkpoint over the whole model
saves nothing: XLA then recomputes everything at once (compiled for an H200, a small GPT's
peak rose from 0.128 to 0.163 GiB).
"""

from __future__ import annotations

import dataclasses
import types
import weakref

import keras
from keras import tree

from keras_mp.keras_glue.keras_internals import (
    Functional,
    StatelessScope,
    get_keras_mask,
    set_keras_mask,
    stored_value,
)

__all__ = ["recompute_elementwise", "saves_matmul_outputs"]

_SAVED = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
_FLAG = "_keras_mp_recompute_elementwise"


def saves_matmul_outputs(primitive, *avals, **params) -> bool:
    """The `jax.checkpoint` policy: save the outputs of matmuls, convolutions and fused
    attention (cuDNN's flash attention, whose recomputation is a whole forward pass)."""
    name = primitive.name
    return name in _SAVED or name.startswith("dot_product_attention")


@dataclasses.dataclass(frozen=True)
class _Region:
    """A stretch of a functional graph run as one `jax.checkpoint`: the sub-model from the
    tensors entering it to those leaving it."""

    inputs: tuple  # KerasTensors of the whole model's graph
    outputs: tuple
    model: keras.Model
    checkpoint: bool = True  # False: one functional model, cut inside instead


def _execution_order(model) -> list:
    """The graph's nodes that compute something, in the order Keras runs them."""
    nodes = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        nodes += [n for n in model._nodes_by_depth[depth] if n.operation and not n.is_input]
    return nodes


def _has_weights(node) -> bool:
    return bool(getattr(node.operation, "weights", None))


def regions(model: keras.Model) -> list[_Region]:
    """Cuts a functional model's graph where the fewest tensors cross (a transformer: at each
    residual add, where only the residual stream is alive besides the inputs and what is made
    of them alone, such as an attention mask), into stretches that each hold weights."""
    nodes = _execution_order(model)
    produced = {id(t): -1 for t in model.inputs}
    last_use = {}
    tensors = {id(t): t for t in model.inputs}
    for i, node in enumerate(nodes):
        for t in node.input_tensors:
            last_use[id(t)] = i
        for t in node.outputs:
            produced[id(t)] = i
            tensors[id(t)] = t
    for t in model.outputs:
        last_use[id(t)] = len(nodes)

    # The inputs, and what weightless operations make of them alone (an attention mask from
    # a padding mask), cross many cuts whatever the cut: they do not count.
    from_inputs = {id(t) for t in model.inputs}
    for node in nodes:
        if not _has_weights(node) and all(id(t) in from_inputs for t in node.input_tensors):
            from_inputs.update(id(t) for t in node.outputs)

    def crossing(p):  # produced at or before p, used after it
        return [
            k
            for k, at in produced.items()
            if at <= p < last_use.get(k, -1) and k not in from_inputs
        ]

    counts = [len(crossing(p)) for p in range(len(nodes) - 1)]
    if not counts:
        return []
    fewest = min(counts)
    cuts = [p for p, c in enumerate(counts) if c == fewest] + [len(nodes) - 1]
    spans, start = [], 0
    for cut in cuts:
        if any(_has_weights(n) for n in nodes[start : cut + 1]) or cut == len(nodes) - 1:
            spans.append((start, cut))
            start = cut + 1
    if len(spans) > 1 and not any(_has_weights(n) for n in nodes[spans[-1][0] :]):
        last = spans.pop()
        spans[-1] = (spans[-1][0], last[1])  # a trailing stretch without weights joins

    out = []
    for start, end in spans:
        inside = nodes[start : end + 1]
        made = {id(t) for n in inside for t in n.outputs}
        ins, seen = [], set()
        for n in inside:
            for t in n.input_tensors:
                if id(t) not in made and id(t) not in seen:
                    seen.add(id(t))
                    ins.append(t)
        outs = [
            tensors[k]
            for k in sorted(made, key=lambda k: produced[k])
            if last_use.get(k, -1) > end
        ]
        sub = keras.Model(ins, outs, name=f"{model.name}_region_{len(out)}")
        alone = len(inside) == 1 and isinstance(inside[0].operation, Functional)
        out.append(_Region(tuple(ins), tuple(outs), sub, checkpoint=not alone))
    return out


def _run_region(region, values, masks, training, owner):
    """The region's sub-model under `jax.checkpoint`. Its variables enter as arguments and
    their updates (a dropout's seed, a batch norm's statistics), the layers' added losses
    and the tensors' Keras masks leave as results: a value made inside the checkpoint must
    not be kept outside it by a side effect."""
    import jax

    variables = region.model.variables

    def forward(ins, in_masks, state):
        with StatelessScope(state_mapping=list(zip(variables, state)), collect_losses=True) as s:
            outs = region.model.call(list(ins), training=training, mask=list(in_masks))
            outs = tree.flatten(outs)
            new_state = [s.get_current_value(v) for v in variables]
        return outs, [get_keras_mask(o) for o in outs], new_state, list(s.losses)

    state = [stored_value(v) for v in variables]
    ins = [values[id(t)] for t in region.inputs]
    in_masks = [masks.get(id(t)) for t in region.inputs]
    run = jax.checkpoint(forward, policy=saves_matmul_outputs) if region.checkpoint else forward
    outs, out_masks, new_state, losses = run(ins, in_masks, state)
    for v, before, after in zip(variables, state, new_state):
        if after is not before:
            v.assign(after)
    for loss in losses:  # counted where the layer's own add_loss counts it
        keras.layers.Layer.add_loss(owner, loss)  # (a Functional's own add_loss refuses)
    for t, value, mask in zip(region.outputs, outs, out_masks):
        values[id(t)] = value
        if mask is not None:
            masks[id(t)] = mask
            set_keras_mask(value, mask)


def recompute_elementwise(model: keras.Model) -> keras.Model:
    """Makes `model`'s training step save only matmul and attention outputs for the
    backward pass and recompute the element-wise work from them (JAX backend).

    The model's graph is cut where the fewest tensors cross (for a transformer, at each
    residual add), and each stretch runs under `jax.checkpoint` with the policy
    `saves_matmul_outputs`: in the backward pass the layer norms' and activations' outputs
    (for a GPT block, the FFN's GELU output is as large as the first FFN matmul's) are
    recomputed from the saved matmul outputs, stretch by stretch, so only one stretch's are
    alive at a time. No matmul runs twice: the step's FLOPs grow by the element-wise work
    alone. Outputs and gradients are the plain model's (the same operations, run again).
    A layer that is itself a functional model (a keras_hub backbone inside its task) is cut
    the same way inside.

    Args:
        model: a functional Keras model (`keras.Model(inputs, outputs)`, `Sequential`, a
            keras_hub backbone or task). It is changed in place, not saved with it: call
            this again after loading.

    Returns:
        `model`.

    Raises:
        ValueError: on a backend other than JAX (TensorFlow's gradient tape takes no
            policy of what to save), or for a subclassed model (no graph to cut).

    Example:

    >>> model = kmp.convert(build_model(), "lean_bfloat16")  # doctest: +SKIP
    >>> kmp.recompute_elementwise(model)  # doctest: +SKIP
    """
    if keras.backend.backend() != "jax":
        raise ValueError(
            "recompute_elementwise runs on the JAX backend only (KERAS_BACKEND=jax); this is "
            f"{keras.backend.backend()!r}."
        )
    if isinstance(model, keras.Sequential) and not model.built:
        raise ValueError(
            f"recompute_elementwise: Sequential model {model.name!r} is not built; build it "
            "(an `Input` first, or `model.build(shape)`) before."
        )
    if not isinstance(model, (Functional, keras.Sequential)):
        raise ValueError(
            f"recompute_elementwise needs a functional model (keras.Model(inputs, outputs), "
            f"Sequential, keras_hub); {model.name!r} is a subclassed {type(model).__name__}, "
            "whose graph is only known when it runs."
        )
    if getattr(model, _FLAG, False):
        return model
    graph = model._functional if isinstance(model, keras.Sequential) else model
    stretches = regions(graph)
    object.__setattr__(model, _FLAG, True)
    for region in stretches:  # a functional model alone in its stretch is cut inside
        if not region.checkpoint:
            recompute_elementwise(next(x for x in region.model.layers if isinstance(x, Functional)))
    if len(stretches) < 2:
        return model
    _REGIONS[graph] = stretches
    # A method bound to the model (not a closure over it): a copy of the model
    # (`copy.deepcopy`, `kmp.convert`) gets it bound to the copy, which cuts its own graph.
    object.__setattr__(model, "call", types.MethodType(_call_in_stretches, model))
    return model


# graph -> its stretches, made once per model object (a copy makes its own)
_REGIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _call_in_stretches(model, inputs, training=None, mask=None, **kwargs):
    """`Functional.call`, stretch by stretch (see `recompute_elementwise`); added losses
    go to `model` (a Sequential's, not its inner graph's)."""
    graph = model._functional if isinstance(model, keras.Sequential) else model
    stretches = _REGIONS.get(graph)
    if stretches is None:
        stretches = _REGIONS[graph] = regions(graph)
    flat = graph._standardize_inputs(inputs)
    values = {id(t): v for t, v in zip(graph.inputs, flat)}
    masks = {}
    for t, m in zip(graph.inputs, tree.flatten(mask) if mask is not None else []):
        if m is not None:
            masks[id(t)] = m
    for region in stretches:
        _run_region(region, values, masks, training, model)
    return tree.pack_sequence_as(graph.output, [values[id(t)] for t in graph.outputs])
