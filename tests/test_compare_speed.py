"""`keras-mp compare` says why its low-precision rows run at the speed they do, times a
matmul-bound step side by side where the machine accelerates low precision, and shows peak
memory where the backend reports it (else says so once) — issue 52."""

import json

import keras
import pytest
from conftest import BACKEND

from keras_mp.cli import main
from keras_mp.cli.compare_speed import speed_notes, train_flops


def test_train_flops_counts_dense_and_conv_exactly():
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inputs, keras.layers.Dense(5)(h))
    conv = 2 * 8 * 8 * (3 * 3 * 3 * 4)  # per sample: output positions x kernel
    dense = 2 * (8 * 8 * 4) * 5
    assert train_flops(model, 16) == 3 * 16 * (conv + dense)


def _results(ratios, probe=None):
    rows = [{"policy": "float32", "steps_per_second": 250.0, "speed_ratio": 1.0}]
    rows += [{"policy": p, "steps_per_second": 250.0 * r, "speed_ratio": r} for p, r in ratios]
    speed = {"train_gflop": 0.06, "hardware": "CPU with AVX512-BF16", "probe": probe}
    return {"rows": rows, "speed": speed}


def test_speed_notes_say_why_low_precision_is_slower_and_show_the_probe():
    probe = {
        "policy": "mixed_bfloat16",
        "hardware": "CPU with AVX512-BF16",
        "workload": "MLP 1024-2048-1024, batch 128, 3.2 GFLOP a step",
        "float32_ms": 135.0,
        "low_ms": 86.0,
        "speedup": 135 / 86,
        "float32_gflops": 60.0,
    }
    why, side = speed_notes(_results([("mixed_bfloat16", 0.55), ("float16", 0.57)], probe))
    assert "60 MFLOP" in why and "4.0 ms in float32 (15.0 GFLOP/s, 25% of the 60 GFLOP/s" in why
    assert "per-op overhead" in why and "every low-precision row below 1.0x" in why
    (mixed, _) = speed_notes(_results([("mixed_bfloat16", 1.2)], probe))
    assert "by the machine's load, not by the precision" in mixed
    assert "mixed_bfloat16 86 ms vs float32 135 ms a step, 1.57x" in side
    (only,) = speed_notes(
        {"rows": [{"policy": "float32", "steps_per_second": 1.0}], "speed": {"hardware": "x"}}
    )
    assert "cannot be faster than float32" in only


def test_compare_reports_peak_memory_where_the_backend_can(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["compare", "--epochs", "1", "--limit", "64", "--out", str(out), "--no-progress"]
    assert main([*argv, "--policies", "float32,mixed_bfloat16"]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert "speed: a step of this model is" in printed
    assert results["speed"]["train_gflop"] == pytest.approx(
        3 * 32 * (18_432 + 589_824 + 10_240) / 1e9
    )
    peaks = [r["peak_memory_bytes"] for r in results["rows"]]
    if BACKEND == "tensorflow":  # TensorFlow's CPU allocator keeps a peak (oneDNN's BFC)
        assert all(p and p > 100_000 for p in peaks)
        assert "┃ peak mem" in printed and "TensorFlow's CPU allocator" in printed
    else:  # JAX's CPU device keeps no statistics: said once, no column of n/a
        assert peaks == [None, None]
        assert printed.count("not reported by the jax backend") == 1
        assert "┃ peak mem" not in printed and "n/a" not in printed
