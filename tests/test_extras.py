"""TensorFlow and JAX are extras: keras_mp without one, and what a feature says it needs."""

import configparser
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from keras_mp.cli import startup
from keras_mp.keras_glue.extras import MissingExtraError, install_command, installed, require

ROOT = Path(__file__).resolve().parents[1]


def test_setup_cfg_makes_tensorflow_an_extra():
    """Issue 46: a JAX user's `pip install keras_mp` pulled TensorFlow (and its CUDA wheels)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = cfg["options"]["install_requires"].split()
    assert not any(r.startswith("tensorflow") for r in requires)
    extras = cfg["options.extras_require"]
    assert extras["tensorflow"].split() == ["tensorflow>=2.21,<2.22"]
    assert extras["jax"].split() == ["jax"]
    assert "tensorflow>=2.21,<2.22" in extras["test"].split()  # scripts/test.sh's TF pass


def test_require_names_the_feature_and_the_install_command():
    require("json", "anything")  # installed: nothing happens
    assert installed("json") and not installed("no_such_module_for_keras_mp")
    with pytest.raises(MissingExtraError, match="my feature needs no_such_module_for_keras_mp"):
        require("no_such_module_for_keras_mp", "my feature")
    assert install_command("jax") == 'pip install "keras_mp[jax]"'
    assert install_command("tensorflow") == 'pip install "keras_mp[tensorflow]"'
    assert issubclass(MissingExtraError, ImportError)


def _run(script: str, env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2", **env},
        timeout=300,
    )


# A JAX-only install: `import tensorflow` fails.
_JAX_ONLY = """
import sys
sys.modules["tensorflow"] = None
import json
import numpy as np
import keras
import keras_mp as kmp

inputs = keras.Input((4,))
model = kmp.convert(keras.Model(inputs, keras.layers.Dense(3)(inputs)), "mixed_bfloat16")
model.compile(optimizer="adam", loss="mse")
history = model.fit(np.ones((8, 4), "float32"), np.ones((8, 3), "float32"), verbose=0)
out = {"backend": keras.backend.backend(), "loss": history.history["loss"][-1]}
try:
    kmp.export_saved_model(model, sys.argv[1])
except ImportError as error:
    out["export"] = [type(error).__name__, str(error)]
print(json.dumps(out))
"""


def test_keras_mp_imports_and_trains_on_jax_without_tensorflow(tmp_path):
    done = _run(_JAX_ONLY, {"KERAS_BACKEND": "jax"}, str(tmp_path / "saved"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["backend"] == "jax" and 0 < out["loss"] < 10
    kind, message = out["export"]
    assert kind == "MissingExtraError"
    assert 'pip install "keras_mp[tensorflow]"' in message and "export_saved_model" in message
    assert not (tmp_path / "saved").exists()


_CLI_WITHOUT_TENSORFLOW = """
import sys
sys.modules["tensorflow"] = None
from keras_mp_launcher import defer_package_init
defer_package_init()
from keras_mp.cli.main import main
sys.exit(main(["doctor"]))
"""


def test_the_cli_says_which_backend_to_install(tmp_path):
    env = {"KERAS_BACKEND": "", "KERAS_HOME": str(tmp_path)}  # Keras' default: tensorflow
    done = _run(_CLI_WITHOUT_TENSORFLOW, env)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("keras-mp doctor: error: the Keras backend 'tensorflow'")
    assert 'pip install "keras_mp[tensorflow]"' in lines[0] and "--backend jax" in lines[0]


def test_configured_backend_reads_as_keras_does(tmp_path):
    assert startup.configured_backend({"KERAS_BACKEND": "jax"}) == "jax"
    assert startup.configured_backend({"KERAS_HOME": str(tmp_path)}) == "tensorflow"
    (tmp_path / "keras.json").write_text(json.dumps({"backend": "torch"}))
    assert startup.configured_backend({"KERAS_HOME": str(tmp_path)}) == "torch"


# A JAX-only install with KERAS_BACKEND unset: Keras starts TensorFlow, which is missing.
_IMPORT_WITHOUT_TENSORFLOW = """
import sys
sys.modules["tensorflow"] = None
import keras_mp
"""
_BENCH_WITHOUT_TENSORFLOW = """
import sys
sys.modules["tensorflow"] = None
import keras_mp_launcher
sys.argv = ["keras-mp", "bench", "--models", "tiny_gpt", "--steps", "1"]
sys.exit(keras_mp_launcher.main())
"""


def test_import_without_the_default_backend_says_to_set_keras_backend(tmp_path):
    # It was Keras' own 21-line traceback ending in "No module named 'tensorflow'".
    env = {"KERAS_BACKEND": "", "KERAS_HOME": str(tmp_path)}
    done = _run(_IMPORT_WITHOUT_TENSORFLOW, env)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: keras_mp cannot start Keras: the Keras backend")
    assert "KERAS_BACKEND=jax" in last and 'pip install "keras_mp[tensorflow]"' in last
    assert "keras/src" not in done.stderr  # raised before Keras' import, not inside it


def test_bench_without_the_default_backend_is_one_line(tmp_path):
    # It crashed with a 61-line traceback (its parent process imported Keras).
    env = {"KERAS_BACKEND": "", "KERAS_HOME": str(tmp_path)}
    done = _run(_BENCH_WITHOUT_TENSORFLOW, env)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keras-mp bench: error: the Keras backend")
    assert "--backend jax" in lines[0]
