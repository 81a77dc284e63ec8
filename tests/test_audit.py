"""kmp.audit: activation range, FP32-sensitive layers, gradient underflow, tensor-core dims."""

import json
import warnings

import keras
import numpy as np
import pytest

import keras_mp as kmp


def _overflow_model(dtype=None):
    """pre (identity) -> big (all weights 2000, relu) -> logits; on ones: big = 128000."""
    inp = keras.Input((64,))
    h = keras.layers.Dense(64, kernel_initializer="identity", name="pre", dtype=dtype)(inp)
    h = keras.layers.Dense(
        32, activation="relu", name="big", dtype=dtype,
        kernel_initializer=keras.initializers.Constant(2000.0),
    )(h)
    h = keras.layers.LayerNormalization(name="norm", dtype=dtype)(h)
    out = keras.layers.Dense(8, name="logits", dtype=dtype)(h)
    return keras.Model(inp, out, name="overflowing")


def test_audit_flags_the_layer_above_fp16_max_in_a_float32_model():
    model = _overflow_model()
    report = kmp.audit(model, np.ones((4, 64), "float32"))
    assert report["big"].max_abs_activation == 64 * 2000.0
    assert report["pre"].max_abs_activation == 1.0
    assert [la.name for la in report.layers if la.overflow_risk] == ["big"]
    assert report.verdict.startswith("NOT safe in float16")
    # The fix is proposed: 'big' produces 128000, the norm after it receives it.
    assert report.advice[0].startswith(
        "For float16, pin 2 layer(s): 'big' (max |output| = 128,000 > 16,376), "
        "'norm' (max |input| = 128,000 > 16,376)"
    )
    assert "'mixed_bfloat16' needs none" in report.advice[0]
    assert "1.28e+05 >FP16!" in str(report)
    # No targets: the gradient columns are skipped and the report says so.
    assert report["big"].variables[0].grad_underflow_at_1 is None
    assert "no targets in `data`: gradient columns skipped (pass (x, y))" in report.notes
    json.dumps(report.to_dict())  # plain data


def test_audit_of_the_bfloat16_model_sees_no_fp16_overflow():
    model = _overflow_model(dtype="mixed_bfloat16")
    report = kmp.audit(model, np.ones((4, 64), "float32"))
    big = report["big"]
    assert (big.compute_dtype, big.variable_dtype) == ("bfloat16", "float32")
    assert big.max_abs_activation == 128000.0  # exact in bfloat16
    assert not big.overflow_risk  # bfloat16 has float32's range
    # The logits projection may run in bfloat16 over FP32 master weights (the loss up-casts)
    # and LayerNormalization computes in float32 internally: neither is flagged.
    assert report["logits"].fp32_reason is None and not report["logits"].runs_low
    assert report["norm"].fp32_reason == "normalization" and not report["norm"].runs_low
    # Without master weights (pure bfloat16) the output layer is flagged.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pure = kmp.audit(_overflow_model(dtype="bfloat16"), np.ones((4, 64), "float32"))
    assert pure["logits"].runs_low and pure["logits"].fp32_reason == "model output"


def test_audit_reports_gradient_underflow_at_scale_1_versus_the_default_2_15():
    # Feature i of x has magnitude 10**(-4 - 0.6 i): gradients span 1e-5 .. 1e-14.
    rng = np.random.default_rng(1)
    x = (rng.uniform(0.5, 1.0, (32, 16)) * 10.0 ** (-4 - 0.6 * np.arange(16))).astype("float32")
    y = rng.normal(size=(32, 8)).astype("float32")
    w = rng.normal(size=(16, 8)).astype("float32")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, use_bias=False)])
    model.layers[0].kernel.assign(w)
    model.compile(optimizer="sgd", loss="mse")
    report = kmp.audit(model, (x, y))
    assert (report.loss_scale, report.loss_scale_source) == (
        2.0**15, "default 2**15; no LossScaleOptimizer compiled")

    # Reference: d/dW mean((xW - y)^2) = 2/(N*U) x^T (xW - y), in float64. An element
    # underflows when |g * s| <= 2**-25 (it rounds to 0 in float16).
    x64, w64, y64 = (a.astype("float64") for a in (x, w, y))
    g = 2.0 / y.size * x64.T @ (x64 @ w64 - y64)
    expected_1 = np.mean(np.abs(g) <= 2.0**-25)
    expected_s = np.mean(np.abs(g) * 2.0**15 <= 2.0**-25)
    v = report.layers[0].variables[0]
    assert abs(v.grad_underflow_at_1 - expected_1) <= 1 / g.size
    assert abs(v.grad_underflow_at_scale - expected_s) <= 1 / g.size
    assert 0.7 < v.grad_underflow_at_1 < 0.85 and 0.2 < v.grad_underflow_at_scale < 0.35
    assert v.grad_max_abs == pytest.approx(np.abs(g).max(), rel=1e-5)
    assert any("underflow in float16 at loss scale 32768: raise the loss scale" in a
               for a in report.advice)

    # With a compiled LossScaleOptimizer its scale is used.
    model.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=2.0**10),
                  loss="mse")
    scaled = kmp.audit(model, (x, y))
    assert scaled.loss_scale == 1024.0
    expected_10 = np.mean(np.abs(g) * 2.0**10 <= 2.0**-25)
    got = scaled.layers[0].variables[0].grad_underflow_at_scale
    assert abs(got - expected_10) <= 1 / g.size


def test_audit_flags_low_softmax_and_misaligned_dims():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inp = keras.Input((6, 16))
    att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=12, name="mha")(inp, inp)
    h = keras.layers.Dense(10, name="proj")(keras.layers.Flatten()(att))
    out = keras.layers.Softmax(name="probs")(h)
    model = keras.Model(inp, out)
    keras.config.set_dtype_policy("float32")
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(4, 6, 16)).astype("float32")
    report = kmp.audit(model, (x, np.arange(4)), tensor_cores=True)  # audited for a GPU
    assert report["probs"].runs_low and report["probs"].fp32_reason == "softmax"
    assert report["mha"].runs_low and report["mha"].fp32_reason == "attention softmax"
    assert report["mha"].matmul_dims == (16, 12, 12)
    assert report["mha"].misaligned_dims == (12, 12)
    assert report["proj"].matmul_dims == (96, 10) and report["proj"].misaligned_dims == (10,)
    assert "Pad 'proj' (Dense) dimensions 10 -> 16: a GPU's tensor cores" in (
        " ".join(report.advice)
    )
    assert "Layer 'probs' (Softmax, softmax) computes in bfloat16: use kmp.layers.Softmax" in (
        " ".join(report.advice)
    )
    assert report["proj"].variables[0].grad_nonfinite == 0.0
    assert report.verdict.startswith("Runs, but with avoidable precision loss")


def test_audit_function_and_errors():
    assert callable(kmp.audit) and kmp.audit is kmp.audit.__globals__["audit"]

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(8)

        def call(self, x):
            return self.d(x)

    sub = Sub()
    x = np.full((2, 8), 0.5, "float32")
    report = kmp.audit(sub, (x, np.zeros((2, 8), "float32")), loss="mse", loss_scale=8.0)
    assert "gradients of loss 'mean_squared_error' on 2 samples" in report.notes
    # Subclassed models are probed per layer too.
    assert [la.name for la in report.layers] == ["dense"]
    kernel, bias = (keras.ops.convert_to_numpy(v) for v in (sub.d.kernel, sub.d.bias))
    assert report["dense"].max_abs_activation == pytest.approx(
        np.abs(x @ kernel + bias).max(), rel=1e-6
    )
    assert report["dense"].max_abs_input == 0.5
    assert report["dense"].variables[1].grad_underflow_at_scale == 0.0  # bias gradient
    assert report.loss_scale == 8.0 and report.verdict.startswith("OK")
    with pytest.raises(ValueError, match="invalid `keep_fp32` entry 3"):
        kmp.audit(sub, x, keep_fp32=[3])
    with pytest.raises(ValueError, match="`model` must be a keras.Model"):
        kmp.audit(keras.layers.Dense(2), np.ones((2, 2)))
    with pytest.raises(ValueError, match="`loss_scale` must be a finite number > 0"):
        kmp.audit(sub, np.ones((2, 8), "float32"), loss_scale=0)
    with pytest.raises(KeyError, match="No layer named 'nope'"):
        report["nope"]


def test_audit_of_an_unscaled_bfloat16_model_gives_no_float16_scale_advice():
    # Under mixed_bfloat16 compile leaves the optimizer unscaled, as it should: float16's
    # gradient underflow is reported for comparison but is no reason to "raise the scale".
    rng = np.random.default_rng(1)
    x = (rng.uniform(0.5, 1.0, (32, 16)) * 10.0 ** (-4 - 0.6 * np.arange(16))).astype("float32")
    y = rng.normal(size=(32, 8)).astype("float32")
    kmp.set_global_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, use_bias=False),
                              keras.layers.Dense(8)])
    model.compile(optimizer="sgd", loss="mse")
    report = kmp.audit(model, (x, y), propose=False)
    assert "needs no loss scaling" in report.loss_scale_source
    assert report.layers[0].variables[0].grad_underflow_at_scale > 0.1  # float16's, shown
    assert not any("loss scale" in a for a in report.advice)
    assert report.verdict == "OK for mixed precision."


def test_audit_advises_tensor_core_padding_only_for_a_gpu():
    """Issue 46: the audit advised padding widths "for tensor cores" on a CPU-only machine."""
    from keras_mp.observe.auditor import _has_tensor_cores

    inputs = keras.Input((12,))
    model = keras.Model(inputs, keras.layers.Dense(10, name="proj")(inputs))
    x = np.random.default_rng(0).normal(size=(4, 12)).astype("float32")
    cpu = kmp.audit(model, x, tensor_cores=False)
    assert cpu["proj"].misaligned_dims == (12, 10)  # the column still says it
    assert not any("Pad" in a for a in cpu.advice)
    assert any("dims%8: tensor-core alignment" in n and "none here" in n for n in cpu.notes)
    gpu = kmp.audit(model, x, tensor_cores=True)
    assert any(a.startswith("Pad 'proj' (Dense) dimensions 12 -> 16, 10 -> 16") for a in gpu.advice)
    here = kmp.audit(model, x)  # this machine decides
    assert any("Pad" in a for a in here.advice) == _has_tensor_cores()
