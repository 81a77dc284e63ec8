"""Models whose activations leave float16's range, as trained models' do.

A trained T5's feed-forward output reaches 66,246 on real text, past float16's 65,504, and
pre-norm transformers' residual streams grow block by block. Random initialisation keeps
activations small, so these builders scale chosen weights until the activations on the
given data reach `target` (float32 can hold them; float16 turns them into inf):

- `t5_encoder`: T5-style pre-norm blocks (RMS norm, ReLU feed-forward without biases),
  the last block's feed-forward output projection (`wo`) scaled;
- `t5_encoder_decoder`: the same encoder and a decoder with cross-attention and an LM head;
- `growing_decoder`: a pre-norm decoder LM whose blocks each add more to the residual
  stream, so that the stream passes `target` in the last block.

They are used by `keras-mp compare --model t5` and the calibration tests.
"""

from __future__ import annotations

import keras
import numpy as np

__all__ = ["growing_decoder", "scale_to", "t5_encoder", "t5_encoder_decoder"]


def _block(x, dim, heads, ffn, name, context=None, causal=False):
    layers = keras.layers
    h = layers.RMSNormalization(name=f"{name}_attn_norm")(x)
    a = layers.MultiHeadAttention(heads, dim // heads, use_bias=False, name=f"{name}_attn")(
        h, h, use_causal_mask=causal
    )
    x = layers.Add(name=f"{name}_attn_res")([x, a])
    if context is not None:
        h = layers.RMSNormalization(name=f"{name}_cross_norm")(x)
        c = layers.MultiHeadAttention(heads, dim // heads, use_bias=False, name=f"{name}_cross")(
            h, context
        )
        x = layers.Add(name=f"{name}_cross_res")([x, c])
    h = layers.RMSNormalization(name=f"{name}_ffn_norm")(x)
    h = layers.Dense(ffn, activation="relu", use_bias=False, name=f"{name}_wi")(h)
    h = layers.Dense(dim, use_bias=False, name=f"{name}_wo")(h)
    return layers.Add(name=f"{name}_ffn_res")([x, h])


def _encoder(tokens, vocab, dim, heads, ffn, blocks, prefix="enc"):
    h = keras.layers.Embedding(vocab, dim, name=f"{prefix}_tokens")(tokens)
    for i in range(blocks):
        h = _block(h, dim, heads, ffn, f"{prefix}{i}")
    return keras.layers.RMSNormalization(name=f"{prefix}_final_norm")(h)


def scale_to(model: keras.Model, x, layer_names, target: float) -> dict:
    """Scales each named layer's kernel so that its largest |output| on `x` is `target`.

    Layers are scaled in order (a later one sees the earlier ones' new outputs).

    Args:
        model: A float32 model.
        x: Inputs.
        layer_names: Names of `Dense` layers (output linear in the kernel).
        target: The largest |output| wanted.

    Returns:
        `{name: scale factor}`.
    """
    from keras_mp.conversion.probe import trace

    factors = {}
    for name in layer_names:
        layer = model.get_layer(name)
        peak = next(r.output_max for r in trace(model, x) if r.layer is layer)
        factors[name] = target / peak
        layer.kernel.assign(layer.kernel * factors[name])
    return factors


def t5_encoder(x, classes: int, dim=32, heads=4, ffn=64, blocks=2, target=1.0e5, seed=0):
    """A T5-style encoder classifier whose last feed-forward output reaches `target` on `x`.

    Args:
        x: int token ids `(batch, length)`: the data the model sees (sets the vocabulary).
        classes: number of classes of the logits head.
        dim, heads, ffn, blocks: sizes.
        target: largest |output| of the last block's `wo` on `x` (float16 max: 65,504).
        seed: weight seed.

    Returns:
        A built float32 `keras.Model` returning logits.
    """
    keras.utils.set_random_seed(seed)
    vocab = int(np.max(x)) + 1
    tokens = keras.Input(x.shape[1:], dtype="int32", name="tokens")
    h = _encoder(tokens, vocab, dim, heads, ffn, blocks)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    logits = keras.layers.Dense(classes, name="logits")(h)
    model = keras.Model(tokens, logits, name="t5_encoder")
    scale_to(model, x[:64], [f"enc{blocks - 1}_wo"], target)
    return model


def t5_encoder_decoder(
    enc_x, dec_x, vocab: int, dim=32, heads=4, ffn=64, blocks=2, target=1.0e5, seed=0
):
    """A T5-style encoder-decoder LM whose encoder's last `wo` reaches `target`.

    Args:
        enc_x / dec_x: int token ids of the encoder and decoder inputs.
        vocab: vocabulary size.
        dim, heads, ffn, blocks: sizes (per stack).
        target: largest |output| of the encoder's last `wo` on the data.
        seed: weight seed.

    Returns:
        A built float32 `keras.Model` taking `{"encoder": ..., "decoder": ...}`, returning
        next-token logits `(batch, dec_length, vocab)`.
    """
    keras.utils.set_random_seed(seed)
    enc = keras.Input(enc_x.shape[1:], dtype="int32", name="encoder")
    dec = keras.Input(dec_x.shape[1:], dtype="int32", name="decoder")
    context = _encoder(enc, vocab, dim, heads, ffn, blocks)
    h = keras.layers.Embedding(vocab, dim, name="dec_tokens")(dec)
    for i in range(blocks):
        h = _block(h, dim, heads, ffn, f"dec{i}", context=context, causal=True)
    h = keras.layers.RMSNormalization(name="dec_final_norm")(h)
    logits = keras.layers.Dense(vocab, name="logits")(h)
    model = keras.Model({"encoder": enc, "decoder": dec}, logits, name="t5_encoder_decoder")
    data = {"encoder": enc_x[:64], "decoder": dec_x[:64]}
    scale_to(model, data, [f"enc{blocks - 1}_wo"], target)
    return model


def growing_decoder(x, vocab: int, dim=32, heads=4, ffn=64, blocks=4, target=1.0e5, seed=0):
    """A pre-norm decoder LM whose residual stream passes `target` in its last block.

    Block `i`'s feed-forward output is scaled to `target * 4**(i - blocks + 1)`: the stream
    grows fourfold per block (the first blocks stay in float16's range).

    Args:
        x: int token ids `(batch, length)`.
        vocab: vocabulary size.
        dim, heads, ffn, blocks: sizes.
        target: largest |feed-forward output| of the last block on `x`.
        seed: weight seed.

    Returns:
        A built float32 `keras.Model` returning next-token logits.
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input(x.shape[1:], dtype="int32", name="tokens")
    h = keras.layers.Embedding(vocab, dim, name="tokens_embedding")(tokens)
    for i in range(blocks):
        h = _block(h, dim, heads, ffn, f"dec{i}", causal=True)
    h = keras.layers.RMSNormalization(name="final_norm")(h)
    logits = keras.layers.Dense(vocab, name="logits")(h)
    model = keras.Model(tokens, logits, name="growing_decoder")
    for i in range(blocks):
        scale_to(model, x[:64], [f"dec{i}_wo"], target * 4.0 ** (i - blocks + 1))
    return model
