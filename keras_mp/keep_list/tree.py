"""A model's layer tree: every layer once, its parent, its address, and which layers are
graph nodes or produce the model's outputs. Nothing here imports the rest of keras_mp."""

from __future__ import annotations

import keras

from keras_mp.keras_glue.keras_internals import Functional, Sequential

__all__ = [
    "addresses",
    "graph_nodes",
    "layer_tree",
    "output_layers",
    "serializes_its_layers",
    "sublayers",
]


def sublayers(layer) -> list:
    """The layers `layer` tracks directly (its children)."""
    return [c for c in getattr(layer, "_layers", []) if isinstance(c, keras.layers.Layer)]


def serializes_its_layers(model) -> bool:
    """A Functional/Sequential model whose config lists its layers (Keras' own get_config)."""
    return isinstance(model, Sequential) or (
        isinstance(model, Functional) and type(model).get_config is Functional.get_config
    )


def graph_nodes(model: keras.Model) -> set:
    """`id`s of the layers that are nodes of a Functional/Sequential graph whose config lists
    its layers (`model` and the nested models of that kind): each saves its own config."""
    layers, _ = layer_tree(model)
    result = set()
    for layer in [model, *layers]:
        if serializes_its_layers(layer):
            result.update(id(c) for c in layer.layers)
    return result


def layer_tree(model: keras.Model) -> tuple[list, dict]:
    """Every layer under `model` once, parents first, and each layer's parent.

    Returns:
        `(layers, parents)`: the layers in depth-first order (`model` excluded), and a dict
        `id(layer) -> parent layer` (the first parent found, for layers shared by several).
    """
    layers, parents, seen = [], {}, {id(model)}

    def visit(parent):
        for child in sublayers(parent):
            if id(child) in seen:
                continue
            seen.add(id(child))
            parents[id(child)] = parent
            layers.append(child)
            visit(child)

    visit(model)
    return layers, parents


def output_layers(model: keras.Model) -> list:
    """The layers producing `model.outputs`, nested models descended into.

    A final stateless `Softmax`/`Activation` is walked back to the layer whose output it
    normalises (both are returned). Subclassed models: the last layer they track.
    """
    if isinstance(model, Functional):
        found = []
        for t in keras.tree.flatten(model.outputs):
            history = getattr(t, "_keras_history", None)
            if history is not None:
                found.append(history[0])
    else:  # Sequential, or subclassed (no graph): the last top-level layer is the head
        found = model.layers[-1:]
    result, seen = [], set()
    while found:
        layer = found.pop()
        if id(layer) in seen or isinstance(layer, keras.layers.InputLayer):
            continue
        seen.add(id(layer))
        result.append(layer)
        if isinstance(layer, keras.Model):
            result.extend(output_layers(layer))
        elif isinstance(layer, (keras.layers.Softmax, keras.layers.Activation)):
            if isinstance(model, Functional) and layer._inbound_nodes:
                node = layer._inbound_nodes[0]
                found += [t._keras_history[0] for t in node.input_tensors]
            elif layer in model.layers[1:]:
                found.append(model.layers[model.layers.index(layer) - 1])
    return result


def addresses(model: keras.Model) -> dict:
    """`id(layer) -> address` for every layer under `model`.

    A layer's address is its path; a layer without one (Keras gives paths only to layers
    with a `build` method: Softmax, Activation and Dropout have none) gets its parent's
    address and its own name, `"parent/name"`.
    """
    layers, parents = layer_tree(model)
    result = {}
    for layer in layers:
        if layer.path:
            result[id(layer)] = layer.path
        else:
            parent = parents.get(id(layer))
            prefix = result.get(id(parent)) if parent is not None else None
            result[id(layer)] = f"{prefix}/{layer.name}" if prefix else layer.name
    return result
