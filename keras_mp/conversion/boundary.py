"""Casts at a pinned block's boundary: its low-precision sublayers hand it float32.

A pin of a layer's own math only (`keep_list.ALONE`: the run check's pins, calibration's
tight pins) runs the block's Python `call` in float32 while its sublayers keep the compute
dtype. The block's own ops then meet a float16 sublayer output beside a float32 tensor of
its own: TensorFlow's raw ops (`x + sublayer(x)`, written with Python operators) refuse
the pair, and `keras.ops` would promote it. So each such sublayer's floating outputs are
cast to its block's compute dtype as they leave it; the sublayer's math, its matmuls
included, stays in the low dtype (T5Gemma's blocks make their attention masks as
`(1 - mask) * -1e9` in the input dtype, NaN in float16: the block's own math is pinned,
its projections are not). What the block computes from those outputs is float32 too (an
attention layer pinned alone multiplies float32 queries and keys).

The cast is decided from the layers' resolved dtypes alone (a low layer inside a
float32 block that is not a model), so a loaded model gets it back from its saved policy
map (`kmp.saving.load_model`). It is an instance attribute `call`, a method bound to the
layer (a copy of the model rebinds it to its own layer), set by `convert.apply_plan`.
A block that is a node of a Functional graph saves only its own dtype: loaded, its
sublayers are made in float32 with it, and nothing is cast.

The same cast hands a converted model's callers float32 (`cast_model_outputs`): the
model's own outputs, and those of the models a subclassed container calls from Python
(a VAE's encoder and decoder, a GAN's generator), so the user's loss code, written for
float32, does not meet float16 beside float32 (the Keras mixed-precision guide's advice
for the last layer). A model that is a node of a Functional graph is not cast: the next
layer casts its inputs itself.

Token ids are kept out of the low dtype (`keep_index_inputs`). keras.io's text classifier
declares `Input(shape=(maxlen,))` (float32) and hands it to its own
`TokenAndPositionEmbedding` layer; that layer casts its float inputs to its compute dtype
before its `Embedding` sees them, so in bfloat16 every id above 256 is rounded (257 fetches
row 256, 1999 becomes 2000 and fails). A graph node fed a float model input that holds an
index-consuming layer (`INDEX_LAYERS`: `Embedding` and its subclasses, `CategoryEncoding`,
`IntegerLookup`, `Hashing`) takes its inputs as they come, as those Keras layers do
themselves (`_convert_input_args = False`); its sublayers still cast what they get.
"""

from __future__ import annotations

import types

import keras

from keras_mp.keras_glue.keras_internals import get_keras_mask, set_keras_mask

__all__ = [
    "INDEX_LAYERS",
    "cast_at_boundaries",
    "cast_model_outputs",
    "casts_to",
    "index_inputs",
    "keep_index_inputs",
]

_ATTR = "_keras_mp_output_dtype"


def casts_to(layer: keras.layers.Layer) -> str | None:
    """The dtype `layer`'s outputs are cast to at its block's boundary, or None."""
    call = vars(layer).get("call")
    if getattr(call, "__func__", None) is _cast_call:
        return vars(layer).get(_ATTR)
    return None


def _cast(t, dtype: str):
    source = getattr(t, "dtype", None)
    if source is None:
        return t
    source = keras.backend.standardize_dtype(source)
    if source == dtype or not keras.backend.is_float_dtype(source):
        return t
    mask = get_keras_mask(t)
    out = keras.ops.cast(t, dtype)
    if mask is not None:
        set_keras_mask(out, mask)
    return out


def _cast_call(self, *args, **kwargs):
    outputs = type(self).call(self, *args, **kwargs)
    dtype = vars(self)[_ATTR]
    return keras.tree.map_structure(lambda t: _cast(t, dtype), outputs)


def cast_at_boundaries(layers: list, parents: dict) -> int:
    """Sets (or removes) the boundary casts of `layers` from their current dtypes.

    Args:
        layers: The layers of a model (`keep_list.layer_tree(model)[0]`).
        parents: `id(layer) -> parent layer`, from the same call.

    Returns:
        How many layers cast their outputs.
    """
    count = 0
    for layer in layers:
        if casts_to(layer) is not None:
            object.__delattr__(layer, "call")
            object.__delattr__(layer, _ATTR)
        parent = parents.get(id(layer))
        if parent is None or isinstance(parent, keras.Model):
            continue  # a graph node: Keras casts a layer's inputs itself
        if isinstance(layer, keras.layers.InputLayer) or "call" in vars(layer):
            continue
        if parent.compute_dtype != "float32" or layer.compute_dtype == "float32":
            continue
        if not keras.backend.is_float_dtype(layer.compute_dtype):
            continue
        object.__setattr__(layer, _ATTR, "float32")
        object.__setattr__(layer, "call", types.MethodType(_cast_call, layer))
        count += 1
    return count


def _graph(layer) -> bool:
    from keras_mp.keras_glue.keras_internals import Functional

    return isinstance(layer, (Functional, keras.Sequential))


def cast_model_outputs(model: keras.Model, layers: list, parents: dict, low: bool) -> int:
    """Sets (`low`) or removes the float32 casts of `model`'s outputs and of the outputs
    of the models under it that a subclassed model calls from Python.

    Args:
        model: the converted model.
        layers, parents: `keep_list.layer_tree(model)`.
        low: whether the policy computes in a low dtype.

    Returns:
        How many models cast their outputs.
    """
    count = 0
    for m in [model, *layers]:
        if not isinstance(m, keras.Model):
            continue
        parent = parents.get(id(m))
        if m is not model and (parent is None or _graph(parent)):
            continue
        if casts_to(m) is not None:
            object.__delattr__(m, "call")
            object.__delattr__(m, _ATTR)
        if not low or "call" in vars(m):
            continue
        object.__setattr__(m, _ATTR, "float32")
        object.__setattr__(m, "call", types.MethodType(_cast_call, m))
        count += 1
    return count


INDEX_LAYERS = (
    keras.layers.Embedding,
    keras.layers.CategoryEncoding,
    keras.layers.IntegerLookup,
    keras.layers.Hashing,
)
_KEPT = "_keras_mp_keeps_indices"


def _index_layers(layer) -> list:
    """The index-consuming layers in `layer`'s subtree (itself excluded)."""
    return [x for x in layer._flatten_layers(include_self=False) if isinstance(x, INDEX_LAYERS)]


def _fed_float_inputs(layer) -> bool:
    """Whether a float model input (an `InputLayer`'s output) reaches `layer` directly."""
    for node in getattr(layer, "_inbound_nodes", []):
        for t in node.input_tensors:
            history = getattr(t, "_keras_history", None)
            if (
                history is not None
                and isinstance(history[0], keras.layers.InputLayer)
                and keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype))
            ):
                return True
    return False


def index_inputs(model: keras.Model) -> dict:
    """Which float inputs of a Functional `model` carry indices, and how many there are.

    Returns:
        `position in model.inputs -> the largest `input_dim` (or `num_tokens`) among the
        index-consuming layers that input reaches (directly or inside a layer it feeds)`.
        Empty for a model without a graph.
    """
    try:
        inputs = list(model.inputs or [])
    except (AttributeError, ValueError):
        return {}
    found = {}
    for layer in model._flatten_layers(include_self=False):
        targets = [layer] if isinstance(layer, INDEX_LAYERS) else _index_layers(layer)
        sizes = [
            n for x in targets
            if isinstance(n := getattr(x, "input_dim", getattr(x, "num_tokens", None)), int)
        ]
        if not sizes:
            continue
        for node in getattr(layer, "_inbound_nodes", []):
            for t in node.input_tensors:
                for i, spec in enumerate(inputs):
                    if t is spec and keras.backend.is_float_dtype(
                        keras.backend.standardize_dtype(spec.dtype)
                    ):
                        found[i] = max(found.get(i, 0), *sizes)
    return found


def keep_index_inputs(layers: list, parents: dict) -> int:
    """Stops the input casts of the graph nodes that hand float model inputs to an
    index-consuming sublayer (or restores them where that no longer holds).

    Args:
        layers, parents: `keep_list.layer_tree(model)`.

    Returns:
        How many layers take their inputs uncast.
    """
    count = 0
    for layer in layers:
        if vars(layer).get(_KEPT):
            object.__setattr__(layer, "_convert_input_args", True)
            object.__delattr__(layer, _KEPT)
        parent = parents.get(id(layer))
        if parent is None or not _graph(parent) or isinstance(layer, INDEX_LAYERS):
            continue
        if not getattr(layer, "_convert_input_args", False):
            continue  # Keras' own preprocessing layers, a nested Functional model
        if not keras.backend.is_float_dtype(layer.compute_dtype) or layer.compute_dtype == (
            "float32"
        ):
            continue
        if not _index_layers(layer) or not _fed_float_inputs(layer):
            continue
        object.__setattr__(layer, "_convert_input_args", False)
        object.__setattr__(layer, _KEPT, True)
        count += 1
    return count
