"""The FP32 keep-list: what its entries mean, and which layers of a model it pins.

A keep-list entry is a layer class, a class name, an `fnmatch` pattern over layer names and
paths, or one of four tokens (`"softmax"`, `"attention"`, `"output"`, `"normalization"`).
`plan(model, policy)` turns a policy's keep-list into a `Plan`: the layers of a model that
run in float32, each with the reason, and the stock layers `convert` replaces by their
keras_mp versions. It holds three rules that make pins safe on real architectures:

1. **A pin covers a whole subtree.** Every sublayer of a pinned layer runs in float32, so a
   composite layer's own math (a residual add, a gate) and its sublayers' outputs agree.
2. **A pin inside an opaque block is lifted to the block.** A layer whose parent is a plain
   layer with its own Python `call` (a transformer block, not a Functional model) cannot
   be pinned alone: on TensorFlow the block's `x + sublayer(x)` fails on mixed dtypes, and
   on JAX it silently promotes the rest of the block. The pin moves up to the outermost such
   block (the child of a model) and the plan says so. Softmax layers and MoE routers are
   the exceptions: attention code consumes probabilities through `keras.ops`, which
   promotes, or through a `Dropout` layer, which casts back; a router's logits go through a
   softmax and a top-k to routing weights that the block casts to its own dtype.
3. **`"output"` pins a head, never a body.** It pins the leaf layer(s) producing the model's
   outputs when they squash (softmax, sigmoid, tanh); the last block of a backbone, or its
   final add or relu, is not a head. A linear logits projection keeps its low-precision
   matmul under the mixed policies (FP32 accumulation; the loss takes the log-softmax in
   float32); under pure policies every output layer with weights is pinned.

Nothing here imports the rest of keras_mp.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

import keras

from keras_mp.keep_list import normalization
from keras_mp.keep_list.added_losses import REASON as LOSS_REASON
from keras_mp.keep_list.added_losses import (
    UPDATE_REASON,
    adds_loss_in_call,
    updates_state_in_call,
)
from keras_mp.keep_list.decision import ALONE, Pin, Plan
from keras_mp.keep_list.tree import (
    addresses,
    graph_nodes,
    layer_tree,
    output_layers,
    serializes_its_layers,
    sublayers,
)
from keras_mp.keep_list.user_pins import user_pin

__all__ = [
    "ALONE",
    "DEFAULT_KEEP_FP32",
    "TOKENS",
    "Pin",
    "Plan",
    "check_entry",
    "emits_logits",
    "entry_matches",
    "graph_nodes",
    "addresses",
    "has_native_fp32_statistics",
    "is_router",
    "layer_rule",
    "layer_tree",
    "output_layers",
    "plan",
    "serializes_its_layers",
    "squashes",
    "sublayers",
]

DEFAULT_KEEP_FP32 = ("softmax", "attention", "output", "normalization", "router")

TOKENS = {
    "softmax": "softmax and log-softmax in float32: stock Softmax layers in a Functional or "
    "Sequential graph become keras_mp.layers.Softmax (float32 inside, output in the compute "
    "dtype); other Softmax layers, Activation('softmax'/'log_softmax') and layers whose "
    "activation is softmax are pinned",
    "attention": "stock MultiHeadAttention in a Functional or Sequential graph becomes "
    "keras_mp.layers.MultiHeadAttention (softmax in float32); Attention and "
    "AdditiveAttention are pinned; the softmax sublayer of any other attention is pinned by "
    "'softmax'",
    "output": "the leaf layer(s) producing the model's outputs (a head, never a block) when "
    "they squash (softmax, sigmoid, tanh), and under pure policies any with weights; a linear "
    "logits projection keeps its matmul in the compute dtype under the mixed policies (FP32 "
    "accumulation; the loss takes the log-softmax in float32)",
    "router": "the router of a mixture-of-experts block (keras_hub's Mixtral, Qwen MoE, "
    "Qwen3 MoE, Qwen3.5 MoE): its logits choose the experts through a softmax and a top-k, and "
    "feed the load-balancing loss; pinned alone, not lifted to its block (the experts stay "
    "in the compute dtype), as Switch Transformers keep the router in float32",
    "normalization": "normalization statistics in float32: Keras' BatchNormalization, "
    "LayerNormalization, GroupNormalization and RMSNormalization compute them in float32 "
    "internally and are not pinned; other Keras normalization layers are (UnitNormalization, "
    "and the Normalization preprocessing layer, which sees the raw data: adapted on values "
    "past 65,504 its inputs overflow float16)",
}

# Keras normalization layers whose `call` up-casts to float32 for the statistics.
_NATIVE_FP32_STATISTICS = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.RMSNormalization,
)
# `Normalization` sees the raw data (keras_mp.keep_list.normalization): always float32.
_NORMALIZATION = _NATIVE_FP32_STATISTICS + (
    keras.layers.UnitNormalization,
    keras.layers.Normalization,
)
_PROJECTIONS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
)
# keras_hub's tied embedding: called with reverse=True it is the logits projection.
_PROJECTION_NAMES = ("ReversibleEmbedding",)
_SOFTMAX_NAMES = ("softmax", "log_softmax")
_SQUASHING = _SOFTMAX_NAMES + (
    "sigmoid",
    "log_sigmoid",
    "hard_sigmoid",
    "tanh",
    "softsign",
    "softplus",
)


def check_entry(entry: Any) -> Any:
    """Returns `entry` if it is a valid keep-list entry, else raises `ValueError`."""
    if isinstance(entry, type) and issubclass(entry, keras.layers.Layer):
        return entry
    if isinstance(entry, str) and entry.strip():
        return entry
    raise ValueError(
        f"Invalid keep_fp32 entry {entry!r}. Valid entries are keras.layers.Layer subclasses, "
        f"layer class names (e.g. 'BatchNormalization'), fnmatch patterns over layer names or "
        f"paths (e.g. '*head*'), or the tokens {sorted(TOKENS)}."
    )


def _class_names(layer) -> set:
    names = set()
    for c in type(layer).__mro__:
        names.add(c.__name__)
        names.add(keras.saving.get_registered_name(c))
    return names


def _is_softmax_layer(layer) -> bool:
    if isinstance(layer, keras.layers.Softmax):
        return True
    activation = getattr(layer, "activation", None)
    return callable(activation) and getattr(activation, "__name__", "") in _SOFTMAX_NAMES


def squashes(layer: keras.layers.Layer) -> bool:
    """True for a softmax layer, or a layer whose activation is a probability-like squashing
    function (softmax, sigmoid, tanh, ...): its output loses most in low precision."""
    if isinstance(layer, keras.layers.Softmax):
        return True
    activation = getattr(layer, "activation", None)
    return callable(activation) and getattr(activation, "__name__", "") in _SQUASHING


def _head_needs_float32(layer, mixed: bool) -> bool:
    """What `"output"` pins: a leaf output layer that squashes, and under pure policies
    also one with weights. A block is not a head; an add, a pooling or a relu is exact
    enough in the compute dtype; a linear logits projection with FP32 master weights keeps
    its fast matmul (the loss takes the log-softmax in float32)."""
    if sublayers(layer):
        return False
    if squashes(layer):
        return True
    return not mixed and (bool(layer.weights) or isinstance(layer, _PROJECTIONS))


def is_router(layer: keras.layers.Layer) -> bool:
    """True for the router of a mixture-of-experts block: a projection named `*sparse*gate*`
    or `*router*gate*` (keras_hub's Mixtral, Qwen MoE, Qwen3 MoE, Qwen3.5 MoE), not a shared
    expert's gate. Its logits choose the experts through a softmax and a top-k, and these
    blocks cast the routing weights to their own dtype. (GPT-OSS multiplies its router's
    scores into the experts' outputs as they are: its router is left in the compute dtype.)"""
    name = layer.name.lower()
    named = "gate" in name and ("sparse" in name or "router" in name)
    return named and "shared" not in name and getattr(layer, "kernel", None) is not None


def emits_logits(layer: keras.layers.Layer) -> bool:
    """True for a projection with a linear activation: its output is logits, nothing more.

    Dense, EinsumDense and Conv layers without an activation, and keras_hub's
    `ReversibleEmbedding` (the tied logits projection of language models).
    """
    if _class_names(layer) & set(_PROJECTION_NAMES):
        return True
    if not isinstance(layer, _PROJECTIONS):
        return False
    activation = getattr(layer, "activation", None)
    return activation is None or getattr(activation, "__name__", "") == "linear"


def has_native_fp32_statistics(layer: keras.layers.Layer) -> bool:
    """True for Keras normalization layers that compute their statistics in float32."""
    return isinstance(layer, _NATIVE_FP32_STATISTICS)


def entry_matches(entry: Any, layer: keras.layers.Layer, outputs: frozenset = frozenset()) -> bool:
    """Whether keep-list `entry` names `layer`, taken on its own.

    Args:
        entry: A keep-list entry (see `check_entry`).
        layer: A layer.
        outputs: `id`s of the layers producing the model's outputs (for `"output"`).

    Returns:
        True if the entry matches. Tokens match by kind (`"normalization"` matches every
        Keras normalization layer; `plan` decides which of them are actually pinned).
    """
    if isinstance(entry, type):
        return isinstance(layer, entry)
    if entry == "softmax":  # keras_mp's own layers already compute softmax in float32
        return _is_softmax_layer(layer) and not type(layer).__module__.startswith("keras_mp.")
    if entry == "attention":
        return isinstance(layer, (keras.layers.Attention, keras.layers.AdditiveAttention)) or (
            type(layer) is keras.layers.MultiHeadAttention
        )
    if entry == "output":
        return id(layer) in outputs
    if entry == "normalization":
        return isinstance(layer, _NORMALIZATION)
    if entry == "router":
        return is_router(layer)
    if entry in _class_names(layer):
        return True
    return fnmatch.fnmatchcase(layer.name, entry) or (
        layer.path is not None and fnmatch.fnmatchcase(layer.path, entry)
    )


def layer_rule(policy, layer, outputs: frozenset = frozenset(), graph_node: bool = False):
    """What `policy`'s keep-list does to one layer taken on its own.

    Args:
        policy: A `keras_mp.Policy`.
        layer: A layer.
        outputs: `id`s of the layers producing the model's outputs.
        graph_node: whether `layer` is a node of a Functional/Sequential graph whose config
            lists its layers (where a stock layer can be replaced by its keras_mp version).

    Returns:
        `(entry, swap)`: the keep-list entry pinning the layer (or None), and the name of the
        keras_mp layer class replacing it (or None). A pin wins over a swap: a softmax
        producing the model's output is pinned, so the probabilities come out in float32.
    """
    mixed = policy.has_master_weights or policy.is_lean
    swap = None
    for entry in policy.keep_fp32:
        if not entry_matches(entry, layer, outputs):
            continue
        if entry == "normalization" and has_native_fp32_statistics(layer):
            continue  # statistics are float32 already
        if entry == "output" and not _head_needs_float32(layer, mixed):
            continue
        if entry == "softmax" and graph_node and type(layer) is keras.layers.Softmax:
            swap = swap or "Softmax"
            continue
        if entry == "attention" and type(layer) is keras.layers.MultiHeadAttention:
            if graph_node:
                swap = swap or "MultiHeadAttention"
            continue  # inside a block: its softmax sublayer is pinned by "softmax"
        return entry, None
    return None, swap


def plan(
    model: keras.Model,
    policy,
    extra: Iterable = (),
    keep: Iterable | None = None,
    exact: Iterable = (),
) -> Plan:
    """Decides which layers of `model` run in float32 under `policy`.

    Args:
        model: A built Keras model.
        policy: A `keras_mp.Policy`.
        extra: Additional `(layer, reason)` pins (e.g. from calibration), placed with the
            same rules as keep-list pins.
        keep: `(layer, reason)` pins taken as they are (not lifted), e.g. the pins of a
            loaded converted model. When given, they replace the rule that keeps the
            float32 layers of a low-precision source model (a loaded model's float32 layers
            may only have missed its dtype).
        exact: `(layer, reason)` pins of the layer alone: not lifted, and its sublayers
            keep their own dtype (the run check's pins: `keras_mp.conversion.runcheck`,
            and the tight pins of calibration, which were checked by running the converted model).

    Returns:
        A `Plan`.
    """
    result = Plan(policy)
    if not policy.is_low_precision:
        return result
    layers, parents = layer_tree(model)
    where = addresses(model)
    outputs = frozenset(id(x) for x in output_layers(model))
    nodes = graph_nodes(model)
    source_low = keep is None and model.compute_dtype != "float32"

    wanted, swaps = [], {}  # (layer, reason); id -> keras_mp class name
    added_loss = []  # (layer, reason): pinned alone, as the run check's pins
    for layer in layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if swaps.get(id(parents.get(id(layer)))) == "MultiHeadAttention":
            continue  # keras_mp's attention brings its own float32 softmax
        entry, swap = layer_rule(policy, layer, outputs, id(layer) in nodes)
        if swap:
            swaps[id(layer)] = swap
        if entry is not None:
            reason = entry.__name__ if isinstance(entry, type) else repr(entry)
            wanted.append((layer, f"keep_fp32 {reason}"))
            note = normalization.plan_note(layer, where[id(layer)], policy.compute_dtype)
            if note:
                result.notes.append(note)
        elif layer is not model and adds_loss_in_call(layer):
            added_loss.append((layer, LOSS_REASON))
        elif layer is not model and updates_state_in_call(layer):
            added_loss.append((layer, UPDATE_REASON))
        elif (reason := user_pin(layer)) is not None and layer is not model:
            wanted.append((layer, reason))  # the user's own float32 choice
        elif source_low and layer.compute_dtype == "float32" and layer.quantization_mode is None:
            wanted.append((layer, "float32 in the source model"))
    wanted += list(extra)

    def lift(layer):
        """The outermost opaque block holding `layer` (itself if its parent is a model)."""
        top = layer
        parent = parents.get(id(top))
        while parent is not None and not isinstance(parent, keras.Model):
            top = parent
            parent = parents.get(id(top))
        return top

    roots = {
        id(layer): (layer, Pin(where[id(layer)], type(layer).__name__, reason))
        for layer, reason in (keep or ())
        if id(layer) in where
    }
    for layer, reason in wanted:
        target, note = layer, ""
        if not (_is_softmax_layer(layer) or is_router(layer) or isinstance(layer, keras.Model)):
            target = lift(layer)
            if target is not layer:
                note = f"lifted from {where[id(layer)]!r} (the block's own math must match it)"
                result.notes.append(
                    f"{where[id(layer)]!r} ({type(layer).__name__}, {reason}) sits inside "
                    f"{where[id(target)]!r} ({type(target).__name__}), whose call combines "
                    "its sublayers' outputs: the whole block runs in float32."
                )
        if id(target) not in roots:
            pin = Pin(where[id(target)], type(target).__name__, reason, note)
            roots[id(target)] = (target, pin)
    if "output" in policy.keep_fp32:
        for layer in layers:  # output blocks the "output" entry leaves alone
            if id(layer) in outputs and sublayers(layer) and not isinstance(layer, keras.Model):
                result.notes.append(
                    f"'output': {where[id(layer)]!r} ({type(layer).__name__}) produces an "
                    "output but is a block, not a head: not pinned."
                )

    def inside_another(layer):
        parent = parents.get(id(layer))
        while parent is not None:
            if id(parent) in roots:
                return True
            parent = parents.get(id(parent))
        return False

    float32_ids = set()
    for key, (layer, pin) in roots.items():
        if inside_another(layer):
            continue
        result.pins.append(pin)
        float32_ids.add(key)
        float32_ids.update(id(s) for s in layer._flatten_layers(include_self=False))
    for layer, reason in [*exact, *added_loss]:
        if id(layer) in float32_ids or id(layer) not in where or inside_another(layer):
            continue
        note = ALONE if sublayers(layer) else ""
        result.pins.append(Pin(where[id(layer)], type(layer).__name__, reason, note))
        float32_ids.add(id(layer))
    result.float32 = {where[i] for i in float32_ids if i in where}
    result.swaps = {  # a pinned block keeps its stock sublayers
        where[i]: f"keras_mp.layers.{name}" for i, name in swaps.items() if i not in float32_ids
    }
    return result
