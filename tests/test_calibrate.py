"""Calibrated conversion: the layers that leave float16's range on the data are pinned."""

import math

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.cli import overflow
from keras_mp.conversion import calibration as calibrate

RNG = np.random.default_rng(0)
ENC = RNG.integers(0, 64, (256, 16)).astype("int32")
DEC = RNG.integers(0, 64, (256, 12)).astype("int32")


def _f32(t):
    return keras.ops.convert_to_numpy(keras.ops.cast(t, "float32"))


def _measured(text: str, prefix: str) -> float:
    """The number written right after `prefix` in `text` ("94,208" -> 94208)."""
    assert prefix in text, text
    return float(text.split(prefix, 1)[1].split()[0].rstrip(",)").replace(",", ""))


def _enc_dec():
    return overflow.t5_encoder_decoder(ENC, DEC, vocab=64)


def _hub_seq2seq(name: str, **kwargs) -> tuple:
    """A tiny keras_hub encoder-decoder backbone (vocabulary 64, seeded) and a batch of 4
    sequences of 8 tokens, no padding."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, name)(vocabulary_size=64, **kwargs)
    ids = np.random.default_rng(0).integers(0, 64, (4, 8)).astype("int32")
    x = {"encoder_token_ids": ids, "encoder_padding_mask": np.ones_like(ids),
         "decoder_token_ids": ids[:, ::-1].copy(), "decoder_padding_mask": np.ones_like(ids)}
    return backbone, x


@pytest.mark.tf_only  # JAX's CPU has no float16 dot
def test_t5_style_model_plain_conversion_overflows_calibrated_one_is_close():
    model = _enc_dec()
    x = {"encoder": ENC[:32], "decoder": DEC[:32]}
    reference = _f32(model(x))
    assert not np.isfinite(_f32(kmp.convert(model, "mixed_float16", check=None)(x))).all()
    converted = kmp.convert(model, "mixed_float16", calibrate=x)
    plan = converted.precision_plan
    # Only what touches the overflowing tensor: the last encoder block's wo, the residual
    # add after it and the final norm receiving the stream; 6 of the 46 layers are float32.
    assert [p.path for p in plan.pins] == ["enc1_wo", "enc1_ffn_res", "enc_final_norm"]
    # The maximum depends on Keras' initializers (94,xxx on Keras 3.15, 99,354 on 3.12).
    for pin, side in ((plan.pins[0], "output"), (plan.pins[2], "input")):
        assert 65504 < _measured(pin.reason, f"calibration: max |{side}| = ") < 200_000
    assert plan.calibration.checked and plan.calibration.limit == 65504 / 4
    assert 0 < plan.calibration.fp32_flops < 0.06  # measured 4.9%
    # Measured: 1.2e-3 of the largest logit (float16 elsewhere).
    result = _f32(converted(x))
    assert np.abs(result - reference).max() / np.abs(reference).max() < 5e-3
    assert "cost: 4.9% of the matmul FLOPs run in float32" in str(plan)


@pytest.mark.tf_only
@pytest.mark.parametrize("steps", [pytest.param(200, marks=pytest.mark.slow), 16])
def test_calibrated_t5_style_model_trains_without_scale_collapse(steps):
    model = _enc_dec()
    x = {"encoder": ENC, "decoder": DEC}
    y = np.roll(DEC, -1, axis=1)  # next token of the decoder input
    converted = kmp.convert(model, "mixed_float16", calibrate={k: v[:32] for k, v in x.items()})
    converted.compile(
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    epochs = steps // 8
    history = converted.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    opt = converted.optimizer
    assert int(keras.ops.convert_to_numpy(opt.skipped_steps.value)) <= 1
    assert float(keras.ops.convert_to_numpy(opt.loss_scale.value)) >= 2.0**14


@pytest.mark.tf_only
def test_growing_residual_stream_pins_only_the_late_blocks():
    model = overflow.growing_decoder(DEC, vocab=64, blocks=4)
    converted = kmp.convert(model, "mixed_float16", calibrate=DEC[:32])
    pinned = [p.path for p in converted.precision_plan.pins]
    # The stream passes 16,376 (65504 / 4) in block 2's feed-forward; blocks 0-1 stay low.
    assert pinned[0] == "dec2_wo" and pinned[-1] == "final_norm"
    assert not any(p.startswith(("dec0", "dec1")) for p in pinned)
    assert converted.get_layer("dec3_wi").compute_dtype == "float16"  # its input is normed
    assert converted.get_layer("dec3_attn").compute_dtype == "float16"
    reference = _f32(model(DEC[:32]))
    result = _f32(converted(DEC[:32]))
    assert np.abs(result - reference).max() / np.abs(reference).max() < 5e-3
    assert not np.isfinite(
        _f32(kmp.convert(model, "mixed_float16", check=None)(DEC[:32]))).all()


def test_bfloat16_pins_nothing_for_range_and_data_forms():
    model = _enc_dec()
    batch = {"encoder": ENC[:8], "decoder": DEC[:8]}
    for data in (batch, (batch, DEC[:8]), [batch, batch], iter([batch] * 3)):
        plan = kmp.plan(model, "mixed_bfloat16", calibrate=data)
        assert plan.calibration.pinned == {} and plan.pins == []
    cal = kmp.plan(model, "mixed_bfloat16", calibrate=[batch] * 3).calibration
    assert cal.batches == 3 and cal.ranges["enc1_wo"].output_max > 65504
    with pytest.raises(ValueError, match="`margin` must be a number >= 1"):
        kmp.plan(model, "mixed_float16", calibrate=batch, margin=0.5)
    with pytest.raises(ValueError, match="holds no batch"):
        kmp.plan(model, "mixed_float16", calibrate=[])


def test_range_pins_rule():
    ranges = {
        "a": calibrate.LayerRange("a", "Dense", input_max=3.0, output_max=20000.0),
        "b": calibrate.LayerRange("b", "LayerNormalization", input_max=20000.0, output_max=3.0),
        "c": calibrate.LayerRange("c", "Dense", input_max=3.0, output_max=16000.0),
        "d": calibrate.LayerRange("d", "Dense", input_max=3.0, output_max=math.inf),
    }
    pins = calibrate.range_pins(ranges, "float16", margin=4.0)
    assert pins == {
        "a": "calibration: max |output| = 20,000 > 16,376",
        "b": "calibration: max |input| = 20,000 > 16,376",
    }  # "c" is inside the limit; "d" overflows in float32 already: pinning cannot help
    assert calibrate.range_pins(ranges, "float16", margin=1.0) == {}
    assert calibrate.range_pins(ranges, "bfloat16", margin=4.0) == {}


@pytest.mark.tf_only
def test_audit_proposes_what_calibrated_convert_disposes():
    model = _enc_dec()
    x = {"encoder": ENC[:32], "decoder": DEC[:32]}
    report = kmp.audit(model, x)
    assert report.verdict.startswith("NOT safe in float16 as it is")
    assert "calibrated conversion pins 3 layer(s)" in report.verdict
    advice = " ".join(report.advice)
    assert 65504 < _measured(advice, "For float16, pin 3 layer(s): 'enc1_wo' (max |output| = ") \
        < 200_000
    assert "4.9% of the matmul FLOPs in float32" in advice
    converted = kmp.convert(model, "mixed_float16", calibrate=x)
    assert [p.path for p in report.proposal.pins] == [
        p.path for p in converted.precision_plan.pins
    ]
    # The converted model's own audit has nothing left to pin for range.
    again = kmp.audit(converted, x)
    assert not any("For float16, pin" in a for a in again.advice)
    json_ready = report.to_dict()
    assert json_ready["proposal"]["pins"][0]["path"] == "enc1_wo"


def test_gradient_range_is_measured_with_a_loss():
    """d loss / d output of every layer, against the analytic value for a linear model."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(hidden))
    x = RNG.normal(size=(5, 4)).astype("float32")
    y = np.zeros((5, 2), "float32")
    ranges = calibrate.measure(model, (x, y), loss="mse")
    pred = keras.ops.convert_to_numpy(model(x))
    d_out = 2 * pred / pred.size  # mean squared error over every element
    w = keras.ops.convert_to_numpy(model.get_layer("out").kernel)
    assert ranges["out"].grad_max == pytest.approx(np.abs(d_out).max(), rel=1e-5)
    assert ranges["hidden"].grad_max == pytest.approx(np.abs(d_out @ w.T).max(), rel=1e-5)
    assert calibrate.measure(model, x)["out"].grad_max is None  # no targets: not measured
    # A gradient past the limit at loss scale 1 is pinned like an activation.
    ranges["out"].grad_max = 1e6
    assert calibrate.range_pins(ranges, "float16", 4.0) == {
        "out": "calibration: max |gradient| = 1,000,000 > 16,376"
    }


@pytest.mark.tf_only
def test_keras_hub_t5_backbone_calibrated_runs_finite_and_trains():
    """keras_hub's own T5 at a tiny size overflows float16 at random initialisation (stock
    Keras gives inf too); calibration finds where, the converted model is finite and trains."""
    backbone, x = _hub_seq2seq("T5Backbone", num_layers=2, num_heads=2, hidden_dim=16,
                               intermediate_dim=32, key_value_dim=8, dropout=0.0)
    reference = {k: _f32(v) for k, v in backbone(x).items()}
    plain = kmp.convert(backbone, "mixed_float16", check=None)
    assert not all(np.isfinite(_f32(v)).all() for v in plain(x).values())
    converted = kmp.convert(backbone, "mixed_float16", calibrate=x)
    plan = converted.precision_plan
    assert plan.calibration.checked and plan.pins
    # The NaN comes from each attention layer's own math (its mask times -1e9 in float16):
    # those layers alone are pinned, their projections stay float16 (issue 28: the whole
    # blocks were pinned, 100% of the matmul FLOPs).
    assert {p.class_name for p in plan.pins} == {"T5MultiHeadAttention"}
    assert all(p.note == "its own math only" for p in plan.pins)
    attention = converted.get_layer("transformer_encoder_layer_0").self_attention
    assert attention.compute_dtype == "float32"
    assert attention.query_projector.compute_dtype == "float16"
    assert plan.calibration.fp32_flops <= 0.25  # measured 0.0%
    for key, value in converted(x).items():
        got = _f32(value)
        assert np.isfinite(got).all()
        assert np.abs(got - reference[key]).max() / np.abs(reference[key]).max() < 1e-2
    converted.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
                      loss="mse", jit_compile=True)
    targets = {k: np.zeros_like(v) for k, v in reference.items()}
    losses = [converted.train_on_batch(x, targets, return_dict=True)["loss"] for _ in range(3)]
    assert np.all(np.isfinite(losses))
    assert int(keras.ops.convert_to_numpy(converted.optimizer.skipped_steps.value)) == 0


@pytest.mark.tf_only
def test_keras_hub_t5gemma_pins_its_blocks_own_math_and_casts_their_sublayers_outputs(
        tmp_path):
    """T5Gemma's blocks make their attention masks as `(1 - mask) * -1e9` in the input
    dtype (NaN in float16) and add their sublayers' outputs with raw TensorFlow ops: the
    blocks' own math is pinned, their projections stay float16 and hand the block float32
    (issue 28: whole blocks were pinned, 100% of the matmul FLOPs in float32)."""
    half = dict(hidden_dim=16, intermediate_dim=32, num_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8,
                layer_types=["sliding_attention", "full_attention"])
    backbone, x = _hub_seq2seq(
        "T5GemmaBackbone", **{f"{side}_{k}": v for side in ("encoder", "decoder")
                              for k, v in half.items()},
        sliding_window=4, cross_attention_hidden_size=16, attn_logit_softcapping=50.0)
    reference = {k: _f32(v) for k, v in backbone(x).items()}
    converted = kmp.convert(backbone, "mixed_float16", calibrate=x)
    plan = converted.precision_plan
    assert plan.calibration.checked
    pinned = {p.class_name for p in plan.pins if not p.reason.startswith("keep_fp32")}
    assert pinned == {"T5GemmaEncoderLayer", "T5GemmaDecoderLayer"}
    block = converted.get_layer("encoder_layer_0")
    assert block.compute_dtype == "float32"
    assert block.mlp.gate_proj.compute_dtype == "float16"
    assert block.self_attn.query_dense.compute_dtype == "float16"
    assert plan.calibration.fp32_flops <= 0.25  # measured 0.0%
    outputs = {k: _f32(v) for k, v in converted(x).items()}
    for key, got in outputs.items():  # measured: 1.1e-3 (encoder and decoder)
        assert np.abs(got - reference[key]).max() / np.abs(reference[key]).max() < 1e-2
    # Loaded (its sublayers renamed by Keras' counter), the pins and the casts come back.
    converted.save(tmp_path / "t5gemma.keras")
    loaded = kmp.saving.load_model(tmp_path / "t5gemma.keras", compile=False)
    assert loaded.get_layer("encoder_layer_0").compute_dtype == "float32"
    assert loaded.get_layer("encoder_layer_0").mlp.gate_proj.compute_dtype == "float16"
    for key, value in loaded(x).items():
        assert np.array_equal(_f32(value), outputs[key])
    converted.compile(optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
                      loss="mse", jit_compile=True)
    targets = {k: np.zeros_like(v) for k, v in reference.items()}
    losses = [converted.train_on_batch(x, targets, return_dict=True)["loss"] for _ in range(3)]
    assert np.all(np.isfinite(losses))


@pytest.mark.slow
@pytest.mark.tf_only
def test_keras_hub_t5_backbone_default_conversion_calibrates_on_its_check_batch():
    """Without a batch, the run check's own batch shows the NaN and convert calibrates."""
    backbone, x = _hub_seq2seq("T5Backbone", num_layers=2, num_heads=2, hidden_dim=16,
                               intermediate_dim=32, key_value_dim=8, dropout=0.0)
    default = kmp.convert(backbone, "mixed_float16")
    assert all(np.isfinite(_f32(v)).all() for v in default(x).values())
    assert any("calibrated on it" in n for n in default.precision_plan.notes)
    assert {p.class_name for p in default.precision_plan.pins} == {"T5MultiHeadAttention"}


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class InputDtypeRMSNorm(keras.layers.Layer):
    """keras_hub's T5LayerNorm: the variance in the input dtype (x**2 overflows float16
    for |x| > 256)."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        variance = keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True)
        return self.scale * x * keras.ops.rsqrt(variance + 1e-6)


@keras.saving.register_keras_serializable(package="keras_mp_tests")
class NormedBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = InputDtypeRMSNorm(name="norm", dtype=self.dtype_policy)
        self.ffn = keras.layers.Dense(16, name="ffn", dtype=self.dtype_policy)

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.ffn.build(input_shape)

    def call(self, x):
        return self.ffn(self.norm(x))


@pytest.mark.tf_only  # JAX's CPU has no float16 dot
def test_norm_with_statistics_in_the_input_dtype_is_pinned_alone_not_its_block():
    inputs = keras.Input((8, 16))
    h = keras.layers.Dense(16, name="embed")(inputs)
    h = NormedBlock(name="block")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    x = (300 * RNG.normal(size=(4, 8, 16))).astype("float32")  # |x| ~ 300: x**2 > 65504
    reference = _f32(model(x))
    # The variance overflows to inf, x * rsqrt(inf) is 0: silent zeros, no inf to see.
    assert np.abs(_f32(kmp.convert(model, "mixed_float16", check=None)(x))).max() == 0
    converted = kmp.convert(model, "mixed_float16", calibrate=x)
    plan = converted.precision_plan
    assert [p.path for p in plan.pins] == ["block/norm"]  # not the whole block
    assert converted.get_layer("block").ffn.compute_dtype == "float16"
    assert plan.calibration.checked and plan.calibration.fp32_flops == 0.0
    result = _f32(converted(x))
    assert np.abs(result - reference).max() / np.abs(reference).max() < 1e-2
