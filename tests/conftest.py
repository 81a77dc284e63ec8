"""Shared test set-up: the backend comes from KERAS_BACKEND (default tensorflow)."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's CPU allocator keeps statistics (the tests of temporary memory read its peak)
# only as a BFC allocator: oneDNN's on CPUs with AVX512 neural-network instructions, this one
# elsewhere (on AVX2-only CPUs `reset_memory_stats("CPU:0")` raises without it).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs the TensorFlow backend")
    for item in items:
        if BACKEND != "tensorflow" and "tf_only" in item.keywords:
            item.add_marker(skip)


def _keras_hub_import_error() -> str | None:
    """Why keras_hub does not import on this Keras (0.32 on Keras 3.16: a mask helper it
    imports from `keras.src` moved), or None where it imports."""
    try:
        import keras_hub  # noqa: F401
    except ImportError as e:
        return f"keras_hub does not import on Keras {keras.__version__}: {e}"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that needs keras_hub skips, naming why, where keras_hub itself cannot import;
    any other ImportError fails as usual."""
    try:
        return (yield)
    except ImportError as e:
        tb = e.__traceback__
        while tb is not None and "keras_hub" not in tb.tb_frame.f_code.co_filename:
            tb = tb.tb_next
        reason = _keras_hub_import_error() if tb is not None else None
        if reason is None:
            raise
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _reset_keras_state():
    """Every test starts from float32, a fixed seed and a clean session."""
    from keras_mp import policies

    keras.config.set_dtype_policy("float32")
    policies._global["policy"] = None  # no kmp.set_global_policy in effect
    keras.utils.set_random_seed(0)
    np.random.seed(0)
    yield
    keras.config.set_dtype_policy("float32")
    policies._global["policy"] = None
    keras.backend.clear_session(free_memory=False)
