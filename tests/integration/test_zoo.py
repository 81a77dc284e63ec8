"""The model zoo (zoo.py beside this file) itself: coverage of keras_hub and
keras.applications, and the `core` entries build and run in float32.

`import zoo` works because pytest (default "prepend" import mode) puts this folder on
`sys.path`; `tests/` is not a package.
"""

import inspect

import keras
import numpy as np
import pytest
import zoo

KINDS = {"backbone", "task", "application", "user"}


def _hub_class(entry):
    import keras_hub

    return getattr(keras_hub.models, entry.name.removeprefix("hub."), None)


def test_zoo_covers_every_keras_hub_backbone():
    """Every `keras_hub.models.*Backbone` has an entry (aliases such as ESM2Backbone =
    ESMBackbone count as covered) or a reason in `zoo.SKIPPED`."""
    import keras_hub

    covered = {_hub_class(e) for e in zoo.select(kind="backbone") if e.name.startswith("hub.")}
    assert None not in covered, "a hub.* entry names no class of keras_hub.models"
    missing, stale = [], []
    for name in sorted(dir(keras_hub.models)):
        cls = getattr(keras_hub.models, name)
        if not (name.endswith("Backbone") and inspect.isclass(cls)):
            continue
        if name in zoo.SKIPPED:
            assert zoo.SKIPPED[name].strip(), f"{name}: empty skip reason"
            if cls in covered:
                stale.append(name)
        elif cls not in covered:
            missing.append(name)
    assert not missing, f"keras_hub backbones neither in the zoo nor in SKIPPED: {missing}"
    assert not stale, f"in SKIPPED but also in the zoo: {stale}"
    assert set(zoo.SKIPPED) <= set(dir(keras_hub.models)), "SKIPPED names an unknown class"


def test_zoo_covers_every_keras_application():
    constructors = set()
    for module_name in dir(keras.applications):
        module = getattr(keras.applications, module_name)
        if inspect.ismodule(module):
            constructors |= {
                name
                for name, obj in vars(module).items()
                if name[:1].isupper() and inspect.isfunction(obj)
            }
    entries = {e.name.removeprefix("apps.") for e in zoo.select(kind="application")}
    assert constructors, "found no keras.applications constructors"
    assert constructors <= entries, sorted(constructors - entries)


def test_zoo_registry_is_consistent():
    names = [e.name for e in zoo.ENTRIES]
    assert len(names) == len(set(names))
    for entry in zoo.ENTRIES:
        assert entry.kind in KINDS, entry.name
        assert entry.tags <= zoo.TAGS, entry.name
        assert entry.backends <= {"tensorflow", "jax", "torch"}, entry.name
        assert zoo.get(entry.name) is entry
    core = zoo.select(tags=["core"])
    assert 8 <= len(core) <= 16, [e.name for e in core]
    assert {e.kind for e in core} == KINDS
    with pytest.raises(KeyError):
        zoo.get("hub.NoSuchBackbone")


def test_zoo_inputs_are_deterministic():
    for entry in zoo.ENTRIES:
        first, second = entry.inputs(2), entry.inputs(2)
        keras.tree.map_structure(np.testing.assert_array_equal, first, second)


CORE = [e for e in zoo.select(tags=["core"]) if keras.backend.backend() in e.backends]


@pytest.mark.tf_only  # the conversion subset runs the JAX decoder LMs in float32 too
@pytest.mark.parametrize("entry", CORE, ids=[e.name for e in CORE])
def test_core_entry_builds_and_runs_in_float32(entry):
    model = entry.build()
    assert model.built and model.weights, entry.name
    assert {v.dtype for v in model.weights} <= {"float32", "int32", "int64", "bool"}
    outputs = model.predict_on_batch(entry.inputs(2))
    for output in keras.tree.flatten(outputs):
        output = np.asarray(output)
        assert output.shape[0] == 2, entry.name
        if np.issubdtype(output.dtype, np.floating):
            assert output.dtype == np.float32, entry.name
            assert np.isfinite(output).all(), entry.name
