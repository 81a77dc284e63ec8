"""Recompute whole blocks in the backward pass: gradient checkpointing per decoder block.

`recompute_blocks(model)` makes each of a model's repeated blocks (a keras_hub backbone's
decoder blocks, found by itself or named) keep only its inputs for the backward pass and
run its forward pass again there, block by block. What the forward pass keeps is then one
residual-stream tensor a block (Llama-3-8B at 2048 tokens: 16 MiB a block, 0.5 GiB for 32,
against about 9.8 GiB kept without it), for one more forward pass of the blocks' matmuls
(about a third of the step's FLOPs). `save="matmuls"` keeps the blocks' matmul and
attention outputs too, as `kmp.recompute_elementwise` does, and recomputes the rest.

Unlike Keras' `RematScope`, which must be open while the layers are *made*, this works on
a model already built (from a preset, loaded, converted), passes its Python arguments
(`training`) to the recomputation as they are (Keras' `remat` hands them to
`jax.checkpoint`, which traces them: Keras' `Dropout` then fails), and carries a block's
state (a dropout's seed, a batch norm's statistics) and added losses out of the
recomputed function, so that the backward pass draws the forward pass's dropout mask.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Sequence

import keras
from keras import tree

from keras_mp.keras_glue.keras_internals import (
    Functional,
    StatelessScope,
    get_keras_mask,
    global_state,
    set_keras_mask,
    stored_value,
)

__all__ = ["SAVE", "find_blocks", "recompute_blocks"]

# what each block keeps for the backward pass
SAVE = ("inputs", "matmuls")
_FLAG = "_keras_mp_recompute_blocks"


def _composite(layer) -> bool:
    """A layer made of other layers, holding weights, that is not itself a model."""
    return (
        not isinstance(layer, (Functional, keras.Sequential))
        and bool(layer.weights)
        and any(True for _ in layer._flatten_layers(include_self=False, recursive=False))
    )


def find_blocks(model: keras.Model) -> list[keras.layers.Layer]:
    """The repeated blocks of `model`: the outermost layers made of other layers (not
    models) whose class occurs at least twice, those of the most frequent class (a
    keras_hub backbone's decoder blocks).

    Args:
        model: a Keras model (a keras_hub task or backbone, a functional model).

    Returns:
        The blocks, in the order `model.layers` lists them (empty when none repeats).

    Example:

    >>> [b.name for b in find_blocks(causal_lm)][:2]  # doctest: +SKIP
    ['transformer_layer_0', 'transformer_layer_1']
    """
    found, seen = [], set()

    def walk(layer):
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if id(child) in seen:
                continue
            seen.add(id(child))
            if _composite(child):
                found.append(child)  # outermost: not searched inside
            else:
                walk(child)

    walk(model)
    counts: dict[type, int] = {}
    for layer in found:
        counts[type(layer)] = counts.get(type(layer), 0) + 1
    repeated = {k: n for k, n in counts.items() if n >= 2}
    if not repeated:
        return []
    most = max(repeated, key=lambda k: (repeated[k], _size(next(x for x in found if type(x) is k))))
    return [layer for layer in found if type(layer) is most]


def _size(layer) -> int:
    return sum(math.prod(v.shape) for v in layer.weights)


def _named(model, blocks) -> list:
    """`blocks` (layer names, a regular expression, or layers) as layers of `model`."""
    every = {id(x): x for x in model._flatten_layers(include_self=False)}
    if isinstance(blocks, str):
        pattern = re.compile(blocks)
        chosen = [x for x in every.values() if pattern.fullmatch(x.name)]
        if not chosen:
            raise ValueError(
                f"recompute_blocks: no layer of {model.name!r} has a name matching "
                f"{blocks!r} (fullmatch); its layers' names start "
                f"{[x.name for x in list(every.values())[:8]]}."
            )
        return chosen
    chosen = []
    by_name = {x.name: x for x in every.values()}
    for item in blocks:
        if isinstance(item, keras.layers.Layer):
            if id(item) not in every:
                raise ValueError(
                    f"recompute_blocks: layer {item.name!r} is not a layer of {model.name!r}."
                )
            chosen.append(item)
        elif item in by_name:
            chosen.append(by_name[item])
        else:
            raise ValueError(
                f"recompute_blocks: {model.name!r} has no layer named {item!r}; pass layer "
                "names, layers or a regular expression (blocks='transformer_layer_.*')."
            )
    return chosen


def recompute_blocks(
    model: keras.Model,
    blocks: str | Sequence[str | keras.layers.Layer] | None = None,
    *,
    save: str = "inputs",
) -> keras.Model:
    """Makes each block of `model` run its forward pass again in the backward pass
    (gradient checkpointing, one block at a time).

    In the backward pass each block's forward pass runs again from its saved inputs, so
    the training step keeps, between the forward and the backward pass, only what
    `save` names: with `"inputs"` a transformer keeps one residual-stream tensor a block
    instead of every block's normalised inputs, projections, attention outputs and
    feed-forward activations (the most memory for the most recomputation: one more
    forward pass of the blocks); `"matmuls"` also keeps the matmul and attention outputs
    (JAX only), recomputing only the element-wise work (`kmp.recompute_elementwise`'s
    trade, block by block). Outputs, losses, gradients and dropout masks are the plain
    model's: the same operations run again on the same values, the same seeds.

    JAX runs each block under `jax.checkpoint`; TensorFlow under `tf.recompute_grad`
    (`save="inputs"` only). Call it after `kmp.convert` (which makes a new model) and
    again after loading: it changes the layers' `call` in place and is not saved.

    Args:
        model: a Keras model: a keras_hub task or backbone, a functional model, any model
            whose blocks are layers.
        blocks: the layers to recompute: `None` finds them (`find_blocks`: the most
            frequent class of repeated layers made of layers, a keras_hub backbone's
            decoder blocks); a regular expression matched against the layers' names
            (`"transformer_layer_.*"`); or a list of layer names or layers.
        save: `"inputs"` (default) or `"matmuls"`.

    Returns:
        `model`.

    Raises:
        ValueError: an unknown `save`, `"matmuls"` on a backend other than JAX, a name
            that is no layer of `model`, no repeated block found, or a model already cut
            by `kmp.recompute_elementwise` (recomputations do not nest).

    Example:

    >>> task = kmp.convert(keras_hub.models.Llama3CausalLM(...), "lean_bfloat16")  # doctest: +SKIP
    >>> kmp.recompute_blocks(task)  # each transformer_layer_* recomputed  # doctest: +SKIP
    >>> task.compile(optimizer="adamw"); task.fit(x, y)  # doctest: +SKIP
    """
    backend = keras.backend.backend()
    if save not in SAVE:
        raise ValueError(f"recompute_blocks: save={save!r}; one of {SAVE}.")
    if save == "matmuls" and backend != "jax":
        raise ValueError(
            "recompute_blocks: save='matmuls' needs a checkpoint policy, which only "
            f"jax.checkpoint takes (KERAS_BACKEND=jax); this is {backend!r}: use "
            "save='inputs' (tf.recompute_grad) here."
        )
    if backend not in ("jax", "tensorflow"):
        raise ValueError(
            f"recompute_blocks runs on JAX and TensorFlow; this is {backend!r}: use Keras' "
            "own keras.RematScope while building the model."
        )
    if getattr(model, "_keras_mp_recompute_elementwise", False):
        raise ValueError(
            f"recompute_blocks: {model.name!r} is already cut by recompute_elementwise; "
            "use one or the other (checkpoints inside checkpoints recompute twice)."
        )
    chosen = find_blocks(model) if blocks is None else _named(model, blocks)
    if not chosen:
        raise ValueError(
            f"recompute_blocks: no repeated block found in {model.name!r} (layers made of "
            "layers, of one class, at least twice); name them: "
            "recompute_blocks(model, blocks=['block_0', 'block_1'])."
        )
    for layer in chosen:
        if isinstance(layer, (Functional, keras.Sequential)):
            raise ValueError(
                f"recompute_blocks: {layer.name!r} is a model; name the layers inside it "
                "(or use kmp.recompute_elementwise on it)."
            )
    for layer in chosen:  # all checked first: a refusal changes nothing
        own = layer.__dict__.get("call")
        original = own.__func__ if isinstance(own, types.MethodType) else type(layer).call
        if getattr(layer, _FLAG, None) is not None:
            original = getattr(layer, _FLAG)[0]  # again: a new `save`, the same call
        object.__setattr__(layer, _FLAG, (original, save))
        object.__setattr__(layer, "call", types.MethodType(_recomputed_call, layer))
    return model


def _recomputed_call(layer, *args, **kwargs):
    """`layer`'s own call, its forward pass recomputed in the backward pass: the tensors
    among the arguments and the layer's variables' values go in, the outputs, their Keras
    masks, the variables' new values and the added losses come out; everything else
    (`training`, None, Python numbers) stays Python."""
    original, save = getattr(layer, _FLAG)
    is_tensor = keras.ops.is_tensor
    leaves = tree.flatten((args, kwargs))
    where = [is_tensor(x) for x in leaves]
    tensors = [x for x, t in zip(leaves, where) if t]
    variables = list(layer.variables)
    state = [stored_value(v) for v in variables]
    structure = {}
    context = _keras_context()

    def forward(tensors, state):
        it = iter(tensors)
        full = [next(it) if t else x for x, t in zip(leaves, where)]
        a, k = tree.pack_sequence_as((args, kwargs), full)
        mapping = list(zip(variables, state))
        with (
            _restored(context),
            StatelessScope(state_mapping=mapping, collect_losses=True) as scope,
        ):
            out = original(layer, *a, **k)
            after = [scope.get_current_value(v) for v in variables]
        # only what the call changed leaves (a seed, a statistic; never a weight)
        changed = [i for i, (x, y) in enumerate(zip(state, after)) if x is not y]
        structure.setdefault("changed", changed)
        new_state = [after[i] for i in structure["changed"]]
        flat = tree.flatten(out)
        masks = [get_keras_mask(o) if is_tensor(o) else None for o in flat]
        structure["out"] = out
        structure["masks"] = [m is not None for m in masks]
        return flat, [m for m in masks if m is not None], new_state, list(scope.losses)

    if keras.backend.backend() == "jax":
        import jax

        from keras_mp.memory.recompute import saves_matmul_outputs

        policy = (
            saves_matmul_outputs if save == "matmuls" else jax.checkpoint_policies.nothing_saveable
        )
        flat, masks, new_state, losses = jax.checkpoint(forward, policy=policy)(tensors, state)
    else:
        flat, masks, new_state, losses = _tf_recompute(forward, tensors, state)
    for i, value in zip(structure["changed"], new_state):
        variables[i].assign(value)
    for loss in losses:
        layer.add_loss(loss)
    it = iter(masks)
    for value, has_mask in zip(flat, structure["masks"]):
        if has_mask:
            set_keras_mask(value, next(it))
    return tree.pack_sequence_as(structure["out"], flat)


# Keras' state around a layer's call that its sublayers read: the call context (`training`
# for sublayers not passed it), the autocast scope (mixed precision), the name scope (a
# distribution's layouts). `tf.recompute_grad` runs the forward pass again when the
# gradient is taken, outside the block's `__call__`: it gets them back from here.
_CONTEXT = ("current_call_ctx", "autocast_scope", "name_scope_stack", "distribution")


def _keras_context() -> dict:
    get = global_state.get_global_attribute
    return {k: (list(v) if isinstance(v, list) else v) for k in _CONTEXT for v in [get(k)]}


class _restored:
    """Sets Keras' global state to a `_keras_context()` snapshot, puts it back after."""

    def __init__(self, context: dict):
        self.context = context

    def __enter__(self):
        self.before = {k: global_state.get_global_attribute(k) for k in _CONTEXT}  # as they are
        for k, v in self.context.items():
            global_state.set_global_attribute(k, v)

    def __exit__(self, *exc):
        for k, v in self.before.items():
            global_state.set_global_attribute(k, v)


def _tf_recompute(forward, tensors, state):
    """`forward` under `tf.recompute_grad`, whose function takes and returns flat lists
    of tensors (no None, no keyword arguments in a `tf.function`)."""
    import tensorflow as tf

    n_in = len(tensors)
    counts = {}

    @tf.recompute_grad
    def run(*flat_in):
        flat, masks, new_state, losses = forward(list(flat_in[:n_in]), list(flat_in[n_in:]))
        counts.update(flat=len(flat), masks=len(masks), state=len(new_state))
        return [tf.convert_to_tensor(x) for x in (*flat, *masks, *new_state, *losses)]

    results = run(*tensors, *[tf.convert_to_tensor(s) for s in state])
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    a = counts["flat"]
    b = a + counts["masks"]
    c = b + counts["state"]
    return results[:a], results[a:b], results[b:c], results[c:]
