"""Keras' private API behind one module: found on this Keras, clear errors where not."""

import warnings

import keras
import pytest

from keras_mp import keras_internals


def test_every_internal_is_found_on_this_keras():
    for name in keras_internals._PLACES:
        if name == "jax_nn" and keras.backend.backend() != "jax":
            continue
        assert keras_internals._find(name) is not None, name
    # compile is defined on the backend-neutral trainer every Model inherits from
    assert issubclass(keras.Model, keras_internals.Trainer)
    assert "compile" in vars(keras_internals.Trainer)
    assert issubclass(keras.optimizers.Adam, keras_internals.BaseOptimizer)


def test_a_missing_internal_names_itself_and_the_supported_range(monkeypatch):
    monkeypatch.setitem(keras_internals._PLACES, "Gone", ("keras.src.nowhere:Gone",))
    with pytest.raises(ImportError, match=r"internal `Gone`.*supports Keras 3\.12 to 3\.16"):
        keras_internals._find("Gone")


def test_version_check_refuses_an_old_keras_in_one_line():
    with pytest.raises(ImportError) as info:
        keras_internals.check_version("3.11.3")
    message = str(info.value)
    assert "\n" not in message
    assert "Keras 3.11.3" in message and 'pip install "keras>=3.12,<3.17"' in message


def test_version_check_warns_on_an_untested_newer_keras_and_accepts_the_range():
    with pytest.warns(UserWarning, match=r"tested on Keras 3\.12 to 3\.16; this is Keras 3\.17"):
        keras_internals.check_version("3.17.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for version in ("3.12.0", "3.15.1", "3.16.0.dev2026102704"):
            keras_internals.check_version(version)


def test_setup_cfg_declares_the_supported_range():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "setup.cfg").read_text()
    (low_major, low_minor), (high_major, high_minor) = keras_internals.SUPPORTED_KERAS
    assert re.search(rf"keras>={low_major}\.{low_minor},<{high_major}\.{high_minor}\b", text)
