"""Smoke tests of examples/: each script runs to the end and prints what it promises.

The TensorFlow examples run in one subprocess (one TensorFlow import, `runpy` per script
with a fresh Keras session, as `python examples/NAME.py` would) with
KERAS_MP_EXAMPLE_FAST=1; the JAX loop runs in its own process (it needs the JAX backend).
`examples/multi_device.py` is tested by the distribute tests. The `slow` test runs every
script at full size as its own `python examples/NAME.py` process.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# example -> text its output must contain (checked after a successful run)
TF_EXAMPLES = {
    "cnn_fit": ["logits                 mixed_float16", "validation accuracy", "skipped steps"],
    "transformer_fp32_softmax": [
        "its softmax is keras_mp.numerics.layers.Softmax",
        "validation accuracy",
    ],
    "custom_loop_tf": ["true grad norm       inf", "steps skipped"],
    "convert_fp32_model": ["weights carried over exactly: True", "probs                  float32"],
    "export_saved_model": ["signature input float32", "output float32"],
    "lean_finetune": [
        "mixed_bfloat16  LossScaleOptimizer", "lean_bfloat16   LeanOptimizer", "nats/byte"
    ],
    "tensorboard_monitoring": (
        ["TensorBoard logs in", "epoch_loss_scale", "skipped_steps", "epoch_loss"]
        if importlib.util.find_spec("tensorboard")
        else ["TensorBoard is not installed", "loss_scale.csv"]
    ),
}
JAX_EXAMPLES = {"custom_loop_jax": ["validation accuracy", "loss scale"]}
# example -> the optional package it imports (the example is skipped without it)
NEEDS = {"lean_finetune": "keras_hub"}


def _missing(name: str) -> str | None:
    package = NEEDS.get(name)
    return package if package and importlib.util.find_spec(package) is None else None

_RUNNER = r"""
import os, runpy, sys, traceback
import keras
for name in sys.argv[1:]:
    print(f"=== BEGIN {name}", flush=True)
    os.environ["KERAS_MP_EXAMPLE_OUT"] = os.path.join(os.environ["KERAS_MP_TEST_OUT"], name)
    try:
        runpy.run_path(os.path.join("examples", name + ".py"), run_name="__main__")
        print(f"=== OK {name}", flush=True)
    except SystemExit as e:
        print(f"=== {'OK' if not e.code else 'FAILED'} {name}", flush=True)
    except Exception:
        traceback.print_exc(file=sys.stdout)
        print(f"=== FAILED {name}", flush=True)
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
"""


def _env(tmp, backend):
    return dict(
        os.environ,
        KERAS_BACKEND=backend,
        KERAS_MP_EXAMPLE_FAST="1",
        KERAS_MP_TEST_OUT=str(tmp),
        TF_CPP_MIN_LOG_LEVEL="2",
        MPLBACKEND="Agg",
    )


def _sections(output: str) -> dict:
    sections, name, lines = {}, None, []
    for line in output.splitlines():
        if line.startswith("=== BEGIN "):
            name, lines = line.split()[-1], []
        elif name and (line.startswith("=== OK ") or line.startswith("=== FAILED ")):
            sections[name] = (line.startswith("=== OK "), "\n".join(lines))
            name = None
        elif name:
            lines.append(line)
    return sections


def _run_batch(names, backend, tmp) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, *names],
        cwd=ROOT,
        env=_env(tmp, backend),
        capture_output=True,
        text=True,
        timeout=600,
    )
    sections = _sections(proc.stdout)
    sections["__stderr__"] = proc.stderr[-3000:]
    return sections


@pytest.fixture(scope="module")
def tf_outputs(tmp_path_factory):
    names = [name for name in TF_EXAMPLES if _missing(name) is None]
    return _run_batch(names, "tensorflow", tmp_path_factory.mktemp("examples"))


@pytest.mark.tf_only
@pytest.mark.parametrize("name", list(TF_EXAMPLES))
def test_tensorflow_example_runs(tf_outputs, name):
    if _missing(name):
        pytest.skip(f"{name} needs {_missing(name)}, which is not installed")
    assert name in tf_outputs, f"{name} did not finish:\n{tf_outputs['__stderr__']}"
    ok, output = tf_outputs[name]
    assert ok, f"{name} failed:\n{output[-3000:]}"
    for text in TF_EXAMPLES[name]:
        assert text in output, f"{name}: {text!r} missing from its output:\n{output[-2000:]}"


@pytest.mark.tf_only
def test_custom_loop_tf_skips_overflowing_steps_and_learns(tf_outputs):
    """The loop starts at scale 2**24: the first steps overflow, are skipped, and the
    scale halves each time; training then proceeds (accuracy well above chance)."""
    ok, output = tf_outputs["custom_loop_tf"]
    assert ok, output[-3000:]
    first = next(line for line in output.splitlines() if line.startswith("step    0"))
    assert "inf" in first and "scale 8.38861e+06" in first and "skipped 1" in first
    final = output.splitlines()[-1]
    accuracy = float(final.split("validation accuracy ")[1].split(";")[0])
    skipped = int(final.split("; ")[1].split(" steps skipped")[0])
    assert accuracy > 0.5  # 10 classes: chance is 0.1
    assert skipped >= 1


@pytest.mark.tf_only
def test_export_example_serves_float32_matching_keras(tf_outputs):
    ok, output = tf_outputs["export_saved_model"]
    assert ok, output[-3000:]
    gaps = [float(line.rsplit("= ", 1)[1]) for line in output.splitlines() if "served -" in line]
    assert len(gaps) == 2 and all(g < 1e-2 for g in gaps), output


@pytest.mark.tf_only
def test_jax_custom_loop_example_runs(tmp_path):
    sections = _run_batch(list(JAX_EXAMPLES), "jax", tmp_path)
    assert "custom_loop_jax" in sections, sections["__stderr__"]
    ok, output = sections["custom_loop_jax"]
    assert ok, output[-3000:]
    for text in JAX_EXAMPLES["custom_loop_jax"]:
        assert text in output
    accuracy = float(output.split("validation accuracy ")[1].split(";")[0])
    assert accuracy > 0.5, output


@pytest.mark.slow
@pytest.mark.tf_only
@pytest.mark.parametrize("name", sorted({**TF_EXAMPLES, **JAX_EXAMPLES}))
def test_example_as_its_own_script(name, tmp_path):
    if _missing(name):
        pytest.skip(f"{name} needs {_missing(name)}, which is not installed")
    env = _env(tmp_path, "tensorflow")
    env.pop("KERAS_MP_EXAMPLE_FAST")  # the full-size run
    env["KERAS_MP_EXAMPLE_OUT"] = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
