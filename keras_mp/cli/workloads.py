"""The benchmark workloads: a GPT-style decoder and ResNet-50, at GPU, CPU and test sizes.

Each workload builds its Keras model (under the current dtype policy), makes one batch of
synthetic data, and counts its model FLOPs per train step. Used by `keras_mp.cli.benchmark`.

Example:

```python
from keras_mp.cli.workloads import WORKLOADS

gpt = WORKLOADS["cpu_gpt"]
model = gpt.build(keras)
x, y = gpt.data(np.random.default_rng(0))
gpt.flops_per_step(model) / 1e9      # GFLOP per training step
```
"""

from __future__ import annotations

import dataclasses

__all__ = ["GPT", "WORKLOADS", "ResNet"]


@dataclasses.dataclass(frozen=True)
class GPT:
    """A GPT-style decoder: pre-LN blocks, causal attention, untied vocabulary head."""

    batch: int
    seq: int
    d_model: int
    heads: int
    layers: int
    ffn: int
    vocab: int
    unit = "tokens"

    @property
    def units_per_step(self) -> int:
        return self.batch * self.seq

    @property
    def matmul_params(self) -> int:
        """N of the 6*N*tokens rule: block and head weights (embedding lookup excluded)."""
        d = self.d_model
        return self.layers * (4 * d * d + 2 * d * self.ffn) + self.vocab * d

    def flops_per_step(self, model=None) -> float:
        """6*N*tokens plus attention scores and values, 12*layers*seq*d per token."""
        tokens = self.units_per_step
        return 6 * self.matmul_params * tokens + 12 * self.layers * self.seq * self.d_model * tokens

    def build(self, keras):
        layers = keras.layers
        inputs = keras.Input((self.seq,), dtype="int32", name="tokens")
        x = layers.Embedding(self.vocab, self.d_model, name="embed")(inputs)
        for i in range(self.layers):
            h = layers.LayerNormalization(name=f"ln_attn_{i}")(x)
            h = layers.MultiHeadAttention(self.heads, self.d_model // self.heads, name=f"attn_{i}")(
                h, h, use_causal_mask=True
            )
            x = layers.Add()([x, h])
            h = layers.LayerNormalization(name=f"ln_ffn_{i}")(x)
            h = layers.Dense(self.ffn, activation="gelu", name=f"ffn_in_{i}")(h)
            x = layers.Add()([x, layers.Dense(self.d_model, name=f"ffn_out_{i}")(h)])
        x = layers.LayerNormalization(name="ln_final")(x)
        logits = layers.Dense(self.vocab, name="head")(x)
        return keras.Model(inputs, logits, name="gpt")

    def data(self, rng):
        shape = (self.batch, self.seq)
        return (
            rng.integers(0, self.vocab, shape, dtype="int32"),
            rng.integers(0, self.vocab, shape, dtype="int32"),
        )


@dataclasses.dataclass(frozen=True)
class ResNet:
    """ResNet-50 (`keras.applications.ResNet50(weights=None)`, logits head), or with `blocks`
    a small bottleneck ResNet of the same design (for tests: ResNet-50 takes minutes to trace
    on a small CPU)."""

    batch: int
    size: int
    classes: int
    blocks: tuple | None = None  # bottleneck blocks per stage; None: keras.applications
    width: int = 64
    unit = "images"

    @property
    def units_per_step(self) -> int:
        return self.batch

    def flops_per_step(self, model) -> float:
        """3 (forward + backward) x 2 x multiply-adds: 4.1 G per 224x224 image for ResNet-50
        (scaled by area), else counted over the model's Conv2D and Dense layers."""
        if self.blocks is None:
            return 3 * 2 * 4.1e9 * self.batch * (self.size / 224) ** 2
        import keras

        macs = 0
        for layer in model.layers:
            if isinstance(layer, keras.layers.Conv2D):
                kh, kw = layer.kernel_size
                h, w, c_out = layer.output.shape[1:]
                macs += h * w * c_out * kh * kw * layer.input.shape[-1]
            elif isinstance(layer, keras.layers.Dense):
                macs += layer.input.shape[-1] * layer.units
        return 3 * 2 * macs * self.batch

    def build(self, keras):
        if self.blocks is None:
            return keras.applications.ResNet50(
                weights=None,
                input_shape=(self.size, self.size, 3),
                classes=self.classes,
                classifier_activation=None,
            )
        layers = keras.layers

        def conv_bn(x, filters, kernel, strides=1, relu=True):
            x = layers.Conv2D(filters, kernel, strides, padding="same", use_bias=False)(x)
            x = layers.BatchNormalization()(x)
            return layers.Activation("relu")(x) if relu else x

        inputs = keras.Input((self.size, self.size, 3))
        x = conv_bn(inputs, self.width, 3)
        for stage, count in enumerate(self.blocks):
            filters = self.width * 2**stage
            for block in range(count):
                strides = 2 if block == 0 and stage > 0 else 1
                shortcut = x
                if block == 0:
                    shortcut = conv_bn(x, 4 * filters, 1, strides, relu=False)
                h = conv_bn(x, filters, 1, strides)
                h = conv_bn(h, filters, 3)
                h = conv_bn(h, 4 * filters, 1, relu=False)
                x = layers.Activation("relu")(layers.Add()([shortcut, h]))
        x = layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, layers.Dense(self.classes)(x), name="mini_resnet")

    def data(self, rng):
        x = rng.standard_normal((self.batch, self.size, self.size, 3), dtype="float32")
        return x, rng.integers(0, self.classes, (self.batch,), dtype="int32")


WORKLOADS = {
    "gpt": GPT(batch=16, seq=1024, d_model=1024, heads=16, layers=8, ffn=4096, vocab=32768),
    "resnet50": ResNet(batch=256, size=224, classes=1000),
    "cpu_gpt": GPT(batch=8, seq=256, d_model=256, heads=4, layers=4, ffn=1024, vocab=8192),
    "cpu_resnet": ResNet(batch=32, size=64, classes=100),
    "tiny_gpt": GPT(batch=2, seq=64, d_model=64, heads=4, layers=1, ffn=128, vocab=512),
    "tiny_resnet": ResNet(batch=4, size=32, classes=10, blocks=(1, 1, 1), width=8),
    # ~1.3B parameters (24 x 2048-wide blocks): where FP8 might start to pay (issue 49.4)
    "gpt_1b3": GPT(batch=8, seq=1024, d_model=2048, heads=16, layers=24, ffn=8192, vocab=32768),
}
"""Workload name -> configuration: `gpt`, `gpt_1b3` and `resnet50` for a GPU, `cpu_*` for a CPU,
`tiny_*` for tests."""
