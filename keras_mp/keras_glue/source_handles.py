"""The user's handles on the source model's layers, after `convert` made a copy.

keras.io's transfer-learning guide keeps `base_model` and, after training the head, sets
`base_model.trainable = True` and recompiles. With a converted copy that flag lands on the
original model: the copy fine-tunes its head alone (2 of 23 weights), and nothing says so.
`record` keeps, on the converted model, a weak reference to each source layer and its
`trainable` flag at conversion; `stale_handles_message` (read when the converted model is
compiled, `keras_mp.scaling.autoscale`) names the layers whose flag the user changed on the source
since, while the copy's is still the old one, and the fix: set it on the converted model's
layer (`model.get_layer(name)`), or convert with `in_place=True` (the user's handles are
then the trained model's layers).
"""

from __future__ import annotations

import weakref

import keras

__all__ = ["record", "stale_handles_message"]

_ATTR = "_keras_mp_source_layers"


def record(model: keras.Model, new: keras.Model, pairs: list) -> None:
    """Remembers `model`'s layers (weakly) beside their copies in `new`.

    Args:
        model: The source model.
        new: Its converted copy.
        pairs: `(source layer, copied layer)` pairs (`model_copy.pair_layers`).
    """
    kept = [(weakref.ref(a), a.trainable, weakref.ref(b)) for a, b in pairs]
    kept.append((weakref.ref(model), model.trainable, weakref.ref(new)))
    object.__setattr__(new, _ATTR, kept)


def stale_handles_message(new: keras.Model) -> str | None:
    """A warning when the source model's layers were frozen or unfrozen after `new` was
    converted from it and the copy's were not, else None."""
    stale = []
    for source, was, copy in vars(new).get(_ATTR, ()):
        a, b = source(), copy()
        if a is None or b is None:
            continue
        if a.trainable != was and b.trainable == was:
            stale.append((a, b))
    if not stale:
        return None
    outer = [
        (a, b)
        for a, b in stale
        if not any(b is not c and b in c._flatten_layers(include_self=False) for _, c in stale)
    ]
    names = ", ".join(f"{b.name!r} (trainable={b.trainable})" for _, b in outer[:4])
    more = f" and {len(outer) - 4} more" if len(outer) > 4 else ""
    first = outer[0][1]
    return (
        f"Model {new.name!r} is a converted copy: `trainable` was changed on the source "
        f"model's layer(s) after kmp.convert, not on the copy's {names}{more}, so the copy "
        f"trains {len(new.trainable_weights)} of its {len(new.weights)} weights. Set it on "
        f"the converted model, e.g. model.get_layer({first.name!r}).trainable = "
        f"{not first.trainable}, then compile again; or convert with "
        "kmp.convert(model, policy, in_place=True), which converts the model you hold."
    )
