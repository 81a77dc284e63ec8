"""A zoo of tiny, download-free model builders for testing `kmp.convert`.

Every entry builds one model at a tiny size, seeded, under the *current* Keras dtype
policy (float32 by default), from explicit constructor arguments only: no
`from_preset`, no weights, no network. The zoo covers every keras_hub `*Backbone`
(`ENTRIES` or `SKIPPED` says which, with a reason), the keras_hub task models that
users train (`*CausalLM`, `*TextClassifier`, `*ImageClassifier`, `*Seq2SeqLM`, with
`preprocessor=None`), every `keras.applications` constructor (`weights=None`) and
a set of plain user models (Functional, Sequential, subclassed, nested, shared
layers, recurrent).

Importing: `tests/` is not a package. Under pytest's default ("prepend") import
mode the folder of a test file is put on `sys.path`, so a test in
`tests/integration/` simply does `import zoo`. Scripts put the folder on `sys.path`
themselves (see `scripts/zoo_check.py`):

```python
sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "integration"))
import zoo
```

keras_hub is imported lazily (inside the builders), so importing this module and
building the `apps.*` and `user.*` entries does not need it.

Weight paths are not stable identifiers. Measured with `scripts/zoo_check.py
--rebuild` (Keras 3.15.1, keras_hub 0.32.0): every entry rebuilds with its weights in
the same order, same shapes and (seeded) same values, but in about a quarter of them
(T5*, T5Gemma*, Moonshine, the MoE blocks of Mixtral/Qwen3Moe/QwenMoe, RWKV7, MiT,
SegFormer, SAM, SAM3, ViTDet, Flux, SigLIP, PARSeq, MobileNetV5, ConvNeXt*, a
Sequential) a second build in the same session, or `from_config(get_config())`, gives
other variable paths: sublayers without an explicit name are numbered by a global
counter ("conv2d" -> "conv2d_6"). DINOV2/DINOV3/HGNetV2/DFine change their paths on
`from_config` only (sublayer names are prefixed with the model name). So paths are not
identities across rebuilds: `kmp.convert` copies models as objects, and where it must
rebuild one it pairs weights through the layer tree (`keras_mp.conversion.model_copy`).

Example:

```python
entry = zoo.get("hub.GPT2CausalLM")
model = entry.build()
logits = model.predict_on_batch(entry.inputs(2))
x, y = entry.fit_data(model, 2)
model.compile(optimizer="adam", loss=entry.loss())
model.fit(x, y, epochs=1, verbose=0)
```
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

__all__ = [
    "APPLICATIONS",
    "ENTRIES",
    "SEED",
    "SKIPPED",
    "TAGS",
    "Entry",
    "get",
    "select",
    "ZooOpaqueModel",
    "ZooSubclassedMLP",
    "ZooTwinKernel",
]

SEED = 1234
TAGS = frozenset(
    {
        "encoder",
        "decoder_lm",
        "seq2seq",
        "vision",
        "cnn",
        "audio",
        "moe",
        "multimodal",
        "detector",
        "rnn",
        "core",
    }
)

# keras_hub classes named "*Backbone" that have no entry, with the reason.
SKIPPED = {
    "Backbone": "abstract base class of every keras_hub backbone; not a model on its own",
    "FeaturePyramidBackbone": "abstract base class (pyramid_outputs mixin); not a model on its own",
}

_VOCAB = 64  # token ids are drawn from [1, _VOCAB): 0 is the padding id of several models
_SEQ = 8
_BOTH = frozenset({"tensorflow", "jax"})


@dataclasses.dataclass(frozen=True)
class Entry:
    """One model of the zoo.

    Args:
        name: unique id: "hub.<Class>", "apps.<Constructor>" or "user.<Name>".
        family: the architecture family ("bert", "gpt2", "mobilenetv2", ...).
        kind: "backbone", "task", "application" or "user".
        tags: a subset of `TAGS`; "core" marks the fast default CI subset.
        build: `() -> keras.Model`: builds the model, seeded, under the current
            dtype policy; the model is built (has its weights).
        inputs: `batch_size -> inputs` as numpy arrays (a dict for keras_hub
            text models); deterministic.
        fit_data: `(model, batch_size) -> (x, y)`: ONE batch of `batch_size` samples
            for `model.fit(x, y, batch_size=batch_size)` with `loss()` (CLIP-style
            backbones output (batch, batch) logits: their targets fit one batch only).
        loss: `() -> loss`: a fresh loss for `compile`.
        backends: the backends the entry is expected to build and run on.
        note: a known stock-Keras or keras_hub limitation, empty when none.
    """

    name: str
    family: str
    kind: str
    tags: frozenset
    build: Callable[[], keras.Model]
    inputs: Callable[[int], Any]
    fit_data: Callable[[keras.Model, int], tuple]
    loss: Callable[[], Any]
    backends: frozenset = _BOTH
    note: str = ""


# ---------------------------------------------------------------------------------------
# Inputs, targets and losses.


def _rng(batch_size: int) -> np.random.Generator:
    return np.random.default_rng(SEED + batch_size)


def _array(rng: np.random.Generator, batch_size: int, spec: tuple) -> np.ndarray:
    """One input array from `(kind, shape, arg)`: see `_inputs`."""
    kind, shape, arg = (*spec, None)[:3]
    full = (batch_size, *shape)
    if kind == "tokens":  # arg: vocabulary size
        return rng.integers(1, arg or _VOCAB, size=full).astype("int32")
    if kind == "ones":  # arg: dtype
        return np.ones(full, arg or "int32")
    if kind == "zeros":
        return np.zeros(full, arg or "int32")
    if kind == "positions":
        return np.broadcast_to(np.arange(shape[-1], dtype="int32"), full).copy()
    if kind == "uniform":  # arg: high (default 1)
        return rng.uniform(0.0, arg or 1.0, size=full).astype("float32")
    if kind == "normal":
        return rng.standard_normal(size=full).astype("float32")
    raise ValueError(f"Unknown input kind {kind!r}")


def _inputs(spec: dict | tuple) -> Callable[[int], Any]:
    """`batch_size -> inputs` from a spec: a dict of `name: (kind, shape[, arg])` or one
    such tuple. Kinds: "tokens" (ids in [1, arg)), "ones"/"zeros" (arg: dtype),
    "positions" (0..n-1), "uniform" (in [0, arg or 1)), "normal"."""

    def inputs(batch_size: int) -> Any:
        rng = _rng(batch_size)
        if isinstance(spec, dict):
            return {key: _array(rng, batch_size, value) for key, value in spec.items()}
        return _array(rng, batch_size, spec)

    return inputs


def _text(
    seq: int = _SEQ,
    vocab: int = _VOCAB,
    *,
    segments: bool = False,
    mask: bool = True,
    mask_dtype: str = "int32",
) -> dict:
    spec = {"token_ids": ("tokens", (seq,), vocab)}
    if segments:
        spec["segment_ids"] = ("zeros", (seq,))
    if mask:
        spec["padding_mask"] = ("ones", (seq,), mask_dtype)
    return spec


def _enc_dec(enc: int = _SEQ, dec: int = _SEQ, vocab: int = _VOCAB) -> dict:
    return {
        "encoder_token_ids": ("tokens", (enc,), vocab),
        "encoder_padding_mask": ("ones", (enc,)),
        "decoder_token_ids": ("tokens", (dec,), vocab),
        "decoder_padding_mask": ("ones", (dec,)),
    }


def _image(size: int | tuple, channels: int = 3, high: float = 1.0) -> tuple:
    height, width = (size, size) if isinstance(size, int) else size
    return ("uniform", (height, width, channels), high)


def _sparse_ce() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mse() -> keras.losses.Loss:
    return keras.losses.MeanSquaredError()


def _zeros_like_outputs(inputs: Callable[[int], Any], keys: tuple = ()) -> Callable:
    """Targets for a backbone: float32 zeros shaped like every output (like the outputs
    named in `keys` only, when given: see `_HubFamily.fit_outputs`)."""

    def fit_data(model: keras.Model, batch_size: int) -> tuple:
        x = inputs(batch_size)
        outputs = model.predict_on_batch(x)
        if keys:
            outputs = {key: outputs[key] for key in keys}
        y = keras.tree.map_structure(lambda t: np.zeros(np.shape(t), "float32"), outputs)
        return x, y

    return fit_data


def _mse_for(keys: tuple) -> Callable[[], Any]:
    """A dict of losses: mean squared error on the outputs named in `keys` only."""
    return lambda: {key: keras.losses.MeanSquaredError() for key in keys}


def _labels(inputs: Callable[[int], Any], num_classes: int) -> Callable:
    """Targets for a classifier: integer labels in [0, num_classes)."""

    def fit_data(model: keras.Model, batch_size: int) -> tuple:
        x = inputs(batch_size)
        y = _rng(batch_size).integers(0, num_classes, size=(batch_size,)).astype("int32")
        return x, y

    return fit_data


def _next_tokens(inputs: Callable[[int], Any], key: str = "token_ids") -> Callable:
    """Targets for a language model: the next token of `x[key]`, shape (batch, seq)."""

    def fit_data(model: keras.Model, batch_size: int) -> tuple:
        x = inputs(batch_size)
        return x, np.roll(x[key], -1, axis=1)

    return fit_data


# ---------------------------------------------------------------------------------------
# Builders.


def _seeded(make: Callable[[], keras.Model]) -> Callable[[], keras.Model]:
    def build() -> keras.Model:
        keras.utils.set_random_seed(SEED)
        return make()

    build.__doc__ = make.__doc__
    return build


def _hub(name: str) -> Any:
    """`keras_hub.models.<name>` (keras_hub is imported lazily)."""
    import keras_hub

    return getattr(keras_hub.models, name)


def _hub_src(module: str, name: str) -> Any:
    """`keras_hub.src.models.<module>.<name>`: helper layers that keras_hub.models lacks."""
    return getattr(importlib.import_module(f"keras_hub.src.models.{module}"), name)


def _frozen(tags: Iterable[str]) -> frozenset:
    tags = frozenset(tags)
    unknown = tags - TAGS
    if unknown:
        raise ValueError(f"Unknown tags {sorted(unknown)}")
    return tags


# ---------------------------------------------------------------------------------------
# keras_hub.


@dataclasses.dataclass(frozen=True)
class _HubFamily:
    """A keras_hub backbone and the tasks built on it.

    `kwargs` is a function: composite backbones take fresh sub-model instances."""

    family: str
    backbone: str
    kwargs: Callable[[], dict]
    spec: dict | tuple
    tags: tuple = ()
    vocab: int = _VOCAB
    causal_lm: str = ""
    text_classifier: str = ""
    image_classifier: str = ""
    image_classifier_kwargs: Callable[[], dict] | None = None
    seq2seq: str = ""
    post_build: Callable[[keras.Model], None] | None = None
    fit_outputs: tuple = ()  # backbone fit: only these outputs get a target and a loss
    backends: frozenset = _BOTH
    note: str = ""
    task_note: str = ""


def _decoder(**overrides: Any) -> Callable[[], dict]:
    """Llama-style decoder kwargs (GQA: 4 query heads, 2 key/value heads)."""
    kwargs = dict(
        vocabulary_size=_VOCAB,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
    )
    kwargs.update(overrides)
    return lambda: dict(kwargs)


def _encoder(**overrides: Any) -> Callable[[], dict]:
    """BERT-style encoder kwargs."""
    kwargs = dict(
        vocabulary_size=_VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=_SEQ,
    )
    kwargs.update(overrides)
    return lambda: dict(kwargs)


def _resnet(filters=(64, 8, 16, 16), blocks=(1, 1, 1, 1), strides=(1, 2, 2, 2), **kwargs):
    """A tiny ResNetBackbone (keras_hub requires 64 filters in the first stack)."""
    return _hub("ResNetBackbone")(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=list(filters),
        stackwise_num_blocks=list(blocks),
        stackwise_num_strides=list(strides),
        block_type=kwargs.pop("block_type", "basic_block"),
        **kwargs,
    )


def _clip_like(prefix: str, vision: tuple, text: tuple, **extra: Any) -> Callable[[], dict]:
    """CLIP / MetaCLIP2 / SigLIP: a vision and a text encoder (32x32 images, 8 tokens)."""
    vision_module, vision_cls = vision
    text_module, text_cls = text

    def kwargs() -> dict:
        return dict(
            vision_encoder=_hub_src(vision_module, vision_cls)(
                8, 16, 2, 2, 32, image_shape=(32, 32, 3), name="vision_encoder"
            ),
            text_encoder=_hub_src(text_module, text_cls)(
                _VOCAB, 16, 16, 2, 2, 32, max_sequence_length=_SEQ, name="text_encoder"
            ),
            **extra,
        )

    return kwargs


def _blip2_kwargs() -> dict:
    return dict(
        vision_encoder=_hub_src("blip2.blip2_vision_encoder", "BLIP2VisionEncoder")(
            image_size=32,
            patch_size=8,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            use_patch_bias=True,
            use_class_token=True,
            use_mha_bias=True,
            use_mlp_bias=True,
            dropout_rate=0.0,
            layer_norm_epsilon=1e-6,
            initializer_range=0.02,
        ),
        qformer=_hub_src("blip2.blip2_qformer", "BLIP2QFormer")(
            num_query_tokens=2,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            vision_dim=8,
            cross_attention_frequency=1,
            dropout=0.0,
            layer_norm_epsilon=1e-6,
        ),
        language_model=_hub_src("blip2.blip2_custom_opt", "BLIP2CustomOPT")(
            vocabulary_size=_VOCAB,
            num_layers=2,
            num_heads=2,
            hidden_dim=8,
            intermediate_dim=16,
            num_query_tokens=2,
            qformer_hidden_dim=8,
            max_sequence_length=16,
            dropout=0.0,
            language_projection=None,
        ),
    )


def _dfine_kwargs() -> dict:
    hgnet = _hub("HGNetV2Backbone")(
        stem_channels=[3, 8, 8],
        stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]],
        apply_downsample=[False, True],
        use_lightweight_conv_block=[False, False],
        depths=[1, 1],
        hidden_sizes=[16, 32],
        embedding_size=8,
        use_learnable_affine_block=True,
        hidden_act="relu",
        image_shape=(None, None, 3),
        out_features=["stage1", "stage2"],
    )
    return dict(
        backbone=hgnet,
        decoder_in_channels=[16, 16],
        encoder_hidden_dim=16,
        num_denoising=0,
        num_labels=4,
        hidden_dim=16,
        learn_initial_query=False,
        num_queries=10,
        anchor_image_size=(32, 32),
        feat_strides=[4, 8],
        num_feature_levels=2,
        encoder_in_channels=[16, 32],
        encode_proj_layers=[1],
        num_attention_heads=2,
        encoder_ffn_dim=32,
        num_encoder_layers=1,
        hidden_expansion=0.5,
        depth_multiplier=0.5,
        eval_idx=-1,
        num_decoder_layers=2,
        decoder_attention_heads=2,
        decoder_ffn_dim=32,
        decoder_n_points=[2, 2],
        lqe_hidden_dim=16,
        num_lqe_layers=2,
        out_features=["stage1", "stage2"],
        image_shape=(32, 32, 3),
        seed=0,
    )


def _dinov2(image: int = 28, **overrides: Any) -> dict:
    kwargs = dict(
        patch_size=14,
        num_layers=2,
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        layer_scale_init_value=1.0,
        num_register_tokens=0,
        use_swiglu_ffn=False,
        image_shape=(image, image, 3),
        position_embedding_shape=(image, image, 3),
    )
    kwargs.update(overrides)
    return kwargs


def _t5gemma_kwargs(**overrides: Any) -> dict:
    """T5Gemma's and T5Gemma2's kwargs (T5Gemma2 adds its query/key norm)."""
    side = dict(
        hidden_dim=16,
        intermediate_dim=32,
        num_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    kwargs = dict(
        vocabulary_size=_VOCAB,
        **{f"{part}_{k}": v for part in ("encoder", "decoder") for k, v in side.items()},
        sliding_window=4,
        cross_attention_hidden_size=16,
        attn_logit_softcapping=50.0,
    )
    kwargs.update(overrides)
    return kwargs


def _depth_anything_kwargs() -> dict:
    encoder = _hub("DINOV2Backbone")(
        **_dinov2(
            image=126,
            num_layers=4,
            apply_layernorm=True,
            name="image_encoder",
        )
    )
    return dict(
        image_encoder=encoder,
        reassemble_factors=[4, 2, 1, 0.5],
        neck_hidden_dims=[8, 8, 16, 16],
        fusion_hidden_dim=16,
        head_hidden_dim=8,
        head_in_index=-1,
        feature_keys=["stage1", "stage2", "stage3", "stage4"],
    )


def _flux_kwargs() -> dict:
    return dict(
        input_channels=16,
        hidden_size=32,
        mlp_ratio=2.0,
        num_heads=2,
        depth=1,
        depth_single_blocks=1,
        axes_dim=[4, 6, 6],
        theta=10_000,
        use_bias=True,
        guidance_embed=True,
        image_shape=(8, 16),
        text_shape=(8, 16),
        image_ids_shape=(8, 3),
        text_ids_shape=(8, 3),
        y_shape=(16,),
    )


def _gemma3n_kwargs() -> dict:
    return dict(
        text_vocab_size=_VOCAB,
        text_hidden_size=16,
        num_hidden_layers=2,
        pad_token_id=0,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=[32, 32],
        hidden_activation="gelu_approximate",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        rope_theta=10000.0,
        max_position_embeddings=_SEQ,
        vocab_size_per_layer_input=_VOCAB,
        hidden_size_per_layer_input=4,
        altup_num_inputs=2,
        laurel_rank=2,
    )


def _mobilenet_kwargs() -> dict:
    return dict(
        stackwise_expansion=[[16, 24], [32, 48]],
        stackwise_num_blocks=[2, 2],
        stackwise_num_filters=[[8, 8], [16, 16]],
        stackwise_kernel_size=[[3, 3], [5, 5]],
        stackwise_num_strides=[[2, 1], [2, 1]],
        stackwise_se_ratio=[[None, None], [0.25, 0.25]],
        stackwise_activation=[["relu", "relu"], ["hard_swish", "hard_swish"], ["hard_swish"]],
        stackwise_padding=[[1, 1], [2, 2]],
        output_num_filters=64,
        input_activation="hard_swish",
        output_activation="hard_swish",
        input_num_filters=8,
        image_shape=(32, 32, 3),
        depthwise_filters=8,
        depthwise_stride=2,
        depthwise_residual=False,
        squeeze_and_excite=0.5,
        last_layer_filter=48,
    )


def _mobilenetv5_kwargs() -> dict:
    return dict(
        stackwise_block_types=[["er"], ["uir", "uir"]],
        stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]],
        stackwise_strides=[[2], [2, 1]],
        stackwise_act_layers=[["relu"], ["relu", "relu"]],
        stackwise_exp_ratios=[[4.0], [4.0, 4.0]],
        stackwise_se_ratios=[[0.0], [0.0, 0.0]],
        stackwise_dw_kernel_sizes=[[0], [3, 3]],
        stackwise_dw_start_kernel_sizes=[[0], [0, 0]],
        stackwise_dw_end_kernel_sizes=[[0], [0, 0]],
        stackwise_exp_kernel_sizes=[[3], [0, 0]],
        stackwise_pw_kernel_sizes=[[1], [0, 0]],
        stackwise_num_heads=[[0], [0, 0]],
        stackwise_key_dims=[[0], [0, 0]],
        stackwise_value_dims=[[0], [0, 0]],
        stackwise_kv_strides=[[0], [0, 0]],
        stackwise_use_cpe=[[False], [False, False]],
        image_shape=(32, 32, 3),
        stem_size=8,
        num_features=32,
        use_msfa=False,
    )


def _parseq_kwargs() -> dict:
    encoder = _hub("ViTBackbone")(
        image_shape=(16, 64, 3),
        patch_size=(4, 8),
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        mlp_dim=32,
        use_class_token=False,
        name="image_encoder",
    )
    return dict(
        image_encoder=encoder,
        vocabulary_size=_VOCAB,
        max_label_length=_SEQ,
        decoder_hidden_dim=16,
        num_decoder_layers=1,
        num_decoder_heads=2,
        decoder_mlp_dim=32,
        dropout_rate=0.0,
        attention_dropout=0.0,
    )


def _sam_kwargs() -> dict:
    return dict(
        image_encoder=_hub("ViTDetBackbone")(
            hidden_size=16,
            num_layers=2,
            intermediate_dim=32,
            num_heads=2,
            global_attention_layer_indices=[1],
            patch_size=4,
            num_output_channels=8,
            window_size=4,
            image_shape=(32, 32, 3),
        ),
        prompt_encoder=_hub_src("sam.sam_prompt_encoder", "SAMPromptEncoder")(
            hidden_size=8,
            image_embedding_size=(8, 8),
            input_image_size=(32, 32),
            mask_in_channels=16,
        ),
        mask_decoder=_hub_src("sam.sam_mask_decoder", "SAMMaskDecoder")(
            num_layers=2,
            hidden_size=16,
            intermediate_dim=32,
            num_heads=2,
            embedding_dim=8,
            num_multimask_outputs=3,
            iou_head_depth=3,
            iou_head_hidden_dim=8,
        ),
    )


def _sam3_kwargs() -> dict:
    src = "sam3.sam3_"
    return dict(
        vision_encoder=_hub_src(src + "vision_encoder", "SAM3VisionEncoder")(
            image_shape=(28, 28, 3),
            patch_size=14,
            num_layers=2,
            hidden_dim=16,
            intermediate_dim=32,
            num_heads=2,
            fpn_hidden_dim=16,
            fpn_scale_factors=[4.0, 2.0, 1.0, 0.5],
            pretrain_image_shape=(42, 42, 3),
            window_size=2,
            global_attn_indexes=[1, 2],
        ),
        text_encoder=_hub_src(src + "text_encoder", "SAM3TextEncoder")(
            vocabulary_size=_VOCAB,
            embedding_dim=16,
            hidden_dim=16,
            num_layers=2,
            num_heads=2,
            intermediate_dim=32,
        ),
        geometry_encoder=_hub_src(src + "geometry_encoder", "SAM3GeometryEncoder")(
            num_layers=2, hidden_dim=16, intermediate_dim=32, num_heads=2, roi_size=7
        ),
        detr_encoder=_hub_src(src + "detr_encoder", "SAM3DetrEncoder")(
            num_layers=2, hidden_dim=16, intermediate_dim=32, num_heads=2
        ),
        detr_decoder=_hub_src(src + "detr_decoder", "SAM3DetrDecoder")(
            image_shape=(28, 28, 3),
            patch_size=14,
            num_layers=2,
            hidden_dim=16,
            intermediate_dim=32,
            num_heads=2,
            num_queries=8,
        ),
        mask_decoder=_hub_src(src + "mask_decoder", "SAM3MaskDecoder")(
            num_upsampling_stages=3, hidden_dim=16, num_heads=2
        ),
    )


def _sd3_kwargs() -> dict:
    text_encoder = _hub_src("clip.clip_text_encoder", "CLIPTextEncoder")
    return dict(
        mmdit_patch_size=2,
        mmdit_hidden_dim=32,
        mmdit_num_layers=2,
        mmdit_num_heads=2,
        mmdit_position_size=32,
        mmdit_qk_norm=None,
        mmdit_dual_attention_indices=None,
        vae=_hub_src("vae.vae_backbone", "VAEBackbone")(
            [32, 32, 32, 32],
            [1, 1, 1, 1],
            [32, 32, 32, 32],
            [1, 1, 1, 1],
            sampler_method="mode",
            name="vae",
        ),
        clip_l=text_encoder(20, 32, 32, 2, 2, 64, "quick_gelu", -2, name="clip_l"),
        clip_g=text_encoder(20, 64, 64, 2, 2, 128, "gelu", -2, name="clip_g"),
        image_shape=(32, 32, 3),
    )


def _hub_families() -> list[_HubFamily]:
    text = _text()
    text_segments = _text(segments=True)
    seq2seq = _enc_dec()
    image32 = _image(32)
    return [
        # --- Text encoders.
        _HubFamily(
            "albert",
            "AlbertBackbone",
            _encoder(num_groups=1, num_inner_repetitions=1, embedding_dim=8),
            text_segments,
            ("encoder",),
            text_classifier="AlbertTextClassifier",
        ),
        _HubFamily(
            "bert", "BertBackbone", _encoder(), text_segments, ("encoder",),
            text_classifier="BertTextClassifier",
        ),
        _HubFamily(
            "deberta_v3", "DebertaV3Backbone", _encoder(bucket_size=4), text, ("encoder",),
            text_classifier="DebertaV3TextClassifier",
        ),
        _HubFamily(
            "distil_bert", "DistilBertBackbone", _encoder(), text, ("encoder",),
            text_classifier="DistilBertTextClassifier",
        ),
        _HubFamily(
            "electra",
            "ElectraBackbone",
            lambda: dict(
                vocab_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16, embedding_dim=16,
                intermediate_dim=32, max_sequence_length=_SEQ,
            ),
            text_segments,
            ("encoder",),
        ),
        _HubFamily(
            "esm",
            "ESMBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32, max_sequence_length=_SEQ,
            ),
            _text(mask=False),
            ("encoder",),
            text_classifier="ESMProteinClassifier",
        ),
        _HubFamily(
            "f_net",
            "FNetBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, hidden_dim=16, intermediate_dim=32,
                max_sequence_length=_SEQ,
            ),
            _text(segments=True, mask=False),
            ("encoder",),
        ),
        _HubFamily(
            "roberta", "RobertaBackbone", _encoder(), text, ("encoder",),
            text_classifier="RobertaTextClassifier",
        ),
        _HubFamily(
            "roformer_v2",
            "RoformerV2Backbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32, head_size=8,
            ),
            _text(segments=True, mask=False),
            ("encoder",),
        ),
        _HubFamily("xlm_roberta", "XLMRobertaBackbone", _encoder(), text, ("encoder",)),
        _HubFamily(
            "xlnet",
            "XLNetBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32,
            ),
            text_segments,
            ("encoder",),
        ),
        # --- Decoder language models.
        _HubFamily(
            "bloom",
            "BloomBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32,
            ),
            text,
            ("decoder_lm",),
            causal_lm="BloomCausalLM",
        ),
        _HubFamily(
            "falcon",
            "FalconBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, num_attention_heads=2, hidden_dim=16,
                intermediate_dim=32,
            ),
            text,
            ("decoder_lm",),
            causal_lm="FalconCausalLM",
        ),
        _HubFamily(
            "gemma",
            "GemmaBackbone",
            _decoder(num_query_heads=2, num_key_value_heads=1, head_dim=8),
            text,
            ("decoder_lm",),
            causal_lm="GemmaCausalLM",
        ),
        _HubFamily(
            "gemma3",
            "Gemma3Backbone",
            _decoder(
                num_query_heads=2, num_key_value_heads=1, head_dim=8, image_size=16,
                use_post_ffw_norm=True, use_post_attention_norm=True,
                use_sliding_window_attention=True, sliding_window_size=4,
            ),
            text,
            ("decoder_lm",),
            causal_lm="Gemma3CausalLM",
            note="text only (vision_encoder=None)",
        ),
        _HubFamily(
            "gemma3n",
            "Gemma3nBackbone",
            _gemma3n_kwargs,
            _text(mask_dtype="bool"),
            ("decoder_lm",),
            causal_lm="Gemma3nCausalLM",
            note="text only (no vision/audio encoder)",
        ),
        _HubFamily(
            "gemma4",
            "Gemma4Backbone",
            _decoder(
                num_query_heads=2, num_key_value_heads=1, head_dim=8, image_size=16,
                sliding_window_size=4, sliding_window_pattern=2,
            ),
            {**text, "position_ids": ("positions", (_SEQ,))},
            ("decoder_lm",),
            causal_lm="Gemma4CausalLM",
            note="text only (vision_encoder=None)",
        ),
        _HubFamily(
            "gpt2", "GPT2Backbone", _encoder(), text, ("decoder_lm",), causal_lm="GPT2CausalLM",
        ),
        _HubFamily(
            "gpt_neo_x", "GPTNeoXBackbone", _encoder(), text, ("decoder_lm",),
            causal_lm="GPTNeoXCausalLM",
        ),
        _HubFamily(
            "gpt_oss",
            "GptOssBackbone",
            _decoder(num_experts=4, top_k=2, sliding_window=4, head_dim=4),
            text,
            ("decoder_lm", "moe"),
            causal_lm="GptOssCausalLM",
        ),
        _HubFamily("llama", "LlamaBackbone", _decoder(), text, ("decoder_lm",),
                   causal_lm="LlamaCausalLM"),
        _HubFamily("llama3", "Llama3Backbone", _decoder(), text, ("decoder_lm",),
                   causal_lm="Llama3CausalLM"),
        _HubFamily("mistral", "MistralBackbone", _decoder(sliding_window=4), text,
                   ("decoder_lm",), causal_lm="MistralCausalLM"),
        _HubFamily(
            "mixtral",
            "MixtralBackbone",
            _decoder(num_experts=4, top_k=2, sliding_window=4),
            text,
            ("decoder_lm", "moe"),
            causal_lm="MixtralCausalLM",
        ),
        _HubFamily("opt", "OPTBackbone", _encoder(), text, ("decoder_lm",),
                   causal_lm="OPTCausalLM"),
        _HubFamily("phi3", "Phi3Backbone", _decoder(), text, ("decoder_lm",),
                   causal_lm="Phi3CausalLM"),
        _HubFamily("qwen", "QwenBackbone", _decoder(), text, ("decoder_lm",),
                   causal_lm="QwenCausalLM"),
        _HubFamily("qwen3", "Qwen3Backbone", _decoder(head_dim=4), text, ("decoder_lm",),
                   causal_lm="Qwen3CausalLM"),
        _HubFamily(
            "qwen3_5",
            "Qwen3_5Backbone",
            _decoder(
                head_dim=8,
                layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=4,
                linear_value_head_dim=4,
            ),
            text,
            ("decoder_lm",),
            causal_lm="Qwen3_5CausalLM",
        ),
        _HubFamily(
            "qwen3_5_moe",
            "Qwen3_5MoeBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB,
                num_layers=2,
                num_query_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                hidden_dim=16,
                moe_intermediate_dim=8,
                shared_expert_intermediate_size=8,
                num_experts=4,
                top_k=2,
                layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=4,
                linear_value_head_dim=4,
            ),
            text,
            ("decoder_lm", "moe"),
            causal_lm="Qwen3_5MoeCausalLM",
        ),
        _HubFamily(
            "qwen3_moe",
            "Qwen3MoeBackbone",
            _decoder(head_dim=4, moe_intermediate_dim=16, num_experts=4, top_k=2,
                     norm_top_k_prob=True),
            text,
            ("decoder_lm", "moe"),
            causal_lm="Qwen3MoeCausalLM",
        ),
        _HubFamily(
            "qwen_moe",
            "QwenMoeBackbone",
            _decoder(moe_intermediate_dim=16, shared_expert_intermediate_dim=32, num_experts=4,
                     top_k=2, norm_top_k_prob=True),
            text,
            ("decoder_lm", "moe"),
            causal_lm="QwenMoeCausalLM",
        ),
        _HubFamily(
            "rwkv7",
            "RWKV7Backbone",
            lambda: dict(
                vocabulary_size=_VOCAB, hidden_size=16, num_layers=2, head_size=4,
                intermediate_dim=32, gate_lora=8, mv_lora=8, aaa_lora=8, decay_lora=8,
            ),
            _text(seq=16),
            ("decoder_lm", "rnn"),
            causal_lm="RWKV7CausalLM",
        ),
        _HubFamily(
            "smollm3",
            "SmolLM3Backbone",
            lambda: dict(
                vocabulary_size=_VOCAB,
                hidden_dim=16,
                intermediate_dim=32,
                num_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                attention_bias=False,
                attention_dropout=0.0,
                rope_layer_enabled_list=[True, False],
                layer_types=["attention", "attention"],
                mlp_bias=False,
                layer_norm_epsilon=1e-5,
                max_position_embeddings=32,
                rope_theta=10000.0,
                partial_rotary_factor=1.0,
            ),
            text,
            ("decoder_lm",),
            causal_lm="SmolLM3CausalLM",
        ),
        # --- Encoder-decoder.
        _HubFamily("bart", "BartBackbone", _encoder(), seq2seq, ("seq2seq",),
                   seq2seq="BartSeq2SeqLM"),
        _HubFamily(
            "edrec",
            "EdRecBackbone",
            lambda: dict(
                vocab_size=_VOCAB, num_layers_enc=2, num_layers_dec=2, num_heads=2,
                hidden_dim=16, intermediate_dim=32,
            ),
            seq2seq,
            ("seq2seq",),
            seq2seq="EdRecSeq2SeqLM",
        ),
        _HubFamily(
            "t5",
            "T5Backbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32,
            ),
            seq2seq,
            ("seq2seq",),
            seq2seq="T5Seq2SeqLM",
        ),
        _HubFamily(
            "t5gemma",
            "T5GemmaBackbone",
            _t5gemma_kwargs,
            seq2seq,
            ("seq2seq",),
            seq2seq="T5GemmaSeq2SeqLM",
        ),
        _HubFamily(
            "t5gemma2",
            "T5Gemma2Backbone",
            lambda: _t5gemma_kwargs(use_query_key_norm=True),
            seq2seq,
            ("seq2seq",),
            seq2seq="T5Gemma2Seq2SeqLM",
        ),
        # --- Audio.
        _HubFamily(
            "moonshine",
            "MoonshineBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB,
                filter_dim=16,
                encoder_num_layers=1,
                decoder_num_layers=1,
                hidden_dim=16,
                intermediate_dim=32,
                encoder_num_heads=2,
                decoder_num_heads=2,
                max_position_embeddings=64,
            ),
            {
                "encoder_input_values": ("uniform", (1600, 1)),
                "decoder_token_ids": ("tokens", (_SEQ,)),
                "encoder_padding_mask": ("ones", (1600,), "bool"),
                "decoder_padding_mask": ("ones", (_SEQ,), "bool"),
            },
            ("audio", "seq2seq"),
            seq2seq="MoonshineAudioToText",
        ),
        _HubFamily(
            "whisper",
            "WhisperBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB, num_layers=2, num_heads=2, hidden_dim=16,
                intermediate_dim=32, num_mels=16, max_encoder_sequence_length=16,
                max_decoder_sequence_length=_SEQ,
            ),
            {
                "encoder_features": ("normal", (16, 16)),
                "decoder_token_ids": ("tokens", (_SEQ,)),
                "decoder_padding_mask": ("ones", (_SEQ,)),
            },
            ("audio", "seq2seq"),
        ),
        # --- Vision: CNNs.
        _HubFamily(
            "cspnet",
            "CSPNetBackbone",
            lambda: dict(
                stem_filters=8,
                stem_kernel_size=3,
                stem_strides=1,
                stackwise_strides=2,
                stackwise_depth=[1, 1, 1],
                stackwise_num_filters=[8, 16, 16],
                down_growth=True,
                bottle_ratio=(0.5,) + (1.0,),
                block_ratio=(1.0,) + (0.5,),
                expand_ratio=(2.0,) + (1.0,),
                block_type="dark_block",
                stage_type="csp",
                stem_padding="same",
            ),
            image32,
            ("vision", "cnn"),
        ),
        _HubFamily(
            "densenet",
            "DenseNetBackbone",
            lambda: dict(
                stackwise_num_repeats=[2, 2, 2, 2], growth_rate=4, image_shape=(32, 32, 3)
            ),
            image32,
            ("vision", "cnn"),
            image_classifier="DenseNetImageClassifier",
        ),
        _HubFamily(
            "efficientnet",
            "EfficientNetBackbone",
            lambda: dict(
                stackwise_kernel_sizes=[3, 3, 3, 3],
                stackwise_num_repeats=[1, 1, 1, 1],
                stackwise_input_filters=[8, 8, 16, 16],
                stackwise_output_filters=[8, 16, 16, 24],
                stackwise_expansion_ratios=[1, 4, 4, 4],
                stackwise_squeeze_and_excite_ratios=[0.0, 0.0, 0.25, 0.25],
                stackwise_strides=[1, 2, 2, 2],
                stackwise_block_types=["fused", "fused", "unfused", "unfused"],
                stackwise_force_input_filters=[0] * 4,
                stackwise_nores_option=[False] * 4,
                # num_features keeps its default (1280): keras_hub 0.32 leaves it out of
                # get_config, so any other value does not survive from_config.
                input_shape=(32, 32, 3),
                width_coefficient=1.0,  # keras_hub: required despite the signature's default
                depth_coefficient=1.0,
            ),
            image32,
            ("vision", "cnn"),
            image_classifier="EfficientNetImageClassifier",
            note="keras_hub 0.32: get_config drops num_features (kept at its default here)",
        ),
        _HubFamily(
            "hgnetv2",
            "HGNetV2Backbone",
            lambda: dict(
                embedding_size=8,
                stem_channels=[3, 8, 8],
                hidden_act="relu",
                use_learnable_affine_block=False,
                image_shape=(32, 32, 3),
                depths=[1, 1],
                hidden_sizes=[16, 32],
                stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3]],
                apply_downsample=[False, True],
                use_lightweight_conv_block=[False, False],
            ),
            image32,
            ("vision", "cnn"),
        ),
        _HubFamily(
            "mobilenet",
            "MobileNetBackbone",
            _mobilenet_kwargs,
            image32,
            ("vision", "cnn"),
            image_classifier="MobileNetImageClassifier",
            image_classifier_kwargs=lambda: {"num_features": 32},
        ),
        _HubFamily(
            "mobilenetv5", "MobileNetV5Backbone", _mobilenetv5_kwargs, image32, ("vision", "cnn"),
        ),
        _HubFamily(
            "resnet",
            "ResNetBackbone",
            lambda: dict(
                input_conv_filters=[8],
                input_conv_kernel_sizes=[7],
                stackwise_num_filters=[64, 16, 16],
                stackwise_num_blocks=[1, 1, 1],
                stackwise_num_strides=[1, 2, 2],
                block_type="bottleneck_block",
                image_shape=(32, 32, 3),
            ),
            image32,
            ("vision", "cnn"),
            image_classifier="ResNetImageClassifier",
        ),
        _HubFamily(
            "vgg",
            "VGGBackbone",
            lambda: dict(
                stackwise_num_repeats=[2, 2, 2],
                stackwise_num_filters=[8, 16, 16],
                image_shape=(16, 16, 3),
            ),
            _image(16),
            ("vision", "cnn"),
            image_classifier="VGGImageClassifier",
            # pooling="avg" puts a 7x7 conv head on the (2x2) feature map.
            image_classifier_kwargs=lambda: {"pooling": "flatten", "pooling_hidden_dim": 16},
        ),
        _HubFamily(
            "xception",
            "XceptionBackbone",
            lambda: dict(
                # A pooled middle block must change the width (its residual is strided
                # only by the pointwise projection).
                stackwise_conv_filters=[[8, 16], [32, 32], [32, 32]],
                stackwise_pooling=[False, True, False],
                image_shape=(32, 32, 3),
            ),
            image32,
            ("vision", "cnn"),
            image_classifier="XceptionImageClassifier",
        ),
        # --- Vision: transformers.
        _HubFamily(
            "deit",
            "DeiTBackbone",
            lambda: dict(
                image_shape=(16, 16, 3), patch_size=4, num_layers=2, hidden_dim=16,
                num_heads=2, intermediate_dim=32,
            ),
            _image(16),
            ("vision",),
            image_classifier="DeiTImageClassifier",
        ),
        _HubFamily(
            "dinov2", "DINOV2Backbone", lambda: _dinov2(), {"images": _image(28)}, ("vision",),
        ),
        _HubFamily(
            "dinov3",
            "DINOV3Backbone",
            lambda: dict(
                patch_size=16, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32,
                num_register_tokens=4, image_shape=(32, 32, 3),
            ),
            {"pixel_values": _image(32)},
            ("vision",),
        ),
        _HubFamily(
            "mit",
            "MiTBackbone",
            lambda: dict(
                layerwise_depths=[2, 2],
                image_shape=(32, 32, 3),
                hidden_dims=[8, 16],
                num_layers=2,
                layerwise_num_heads=[1, 2],
                layerwise_sr_ratios=[8, 4],
                max_drop_path_rate=0.1,
                layerwise_patch_sizes=[7, 3],
                layerwise_strides=[4, 2],
            ),
            image32,
            ("vision",),
            image_classifier="MiTImageClassifier",
        ),
        _HubFamily(
            "swin_transformer",
            "SwinTransformerBackbone",
            lambda: dict(
                image_shape=(32, 32, 3), embed_dim=16, depths=(2, 2), num_heads=(2, 4),
                window_size=4,
            ),
            image32,
            ("vision",),
            image_classifier="SwinTransformerImageClassifier",
        ),
        _HubFamily(
            "vit",
            "ViTBackbone",
            lambda: dict(
                image_shape=(16, 16, 3), patch_size=(4, 4), num_layers=2, hidden_dim=16,
                num_heads=2, mlp_dim=32,
            ),
            _image(16),
            ("vision",),
            image_classifier="ViTImageClassifier",
        ),
        _HubFamily(
            "vit_det",
            "ViTDetBackbone",
            lambda: dict(
                image_shape=(16, 16, 3), patch_size=2, hidden_size=16, num_layers=2,
                global_attention_layer_indices=[1], intermediate_dim=32, num_heads=2,
                num_output_channels=8, window_size=2,
            ),
            _image(16),
            ("vision",),
        ),
        _HubFamily(
            "video_prism",
            "VideoPrismBackbone",
            lambda: dict(
                image_shape=(16, 16, 3), num_frames=2, patch_size=4, hidden_dim=16,
                intermediate_dim=32, num_heads=2, num_spatial_layers=1, num_temporal_layers=1,
                num_auxiliary_layers=1,
            ),
            ("uniform", (2, 16, 16, 3)),
            ("vision",),
        ),
        # --- Vision: dense prediction and detection.
        _HubFamily(
            "basnet",
            "BASNetBackbone",
            # projection_filters keeps its default, 64: the width of the first stack.
            lambda: dict(image_encoder=_resnet(), num_classes=1),
            _image(64),
            ("vision", "cnn", "detector"),
        ),
        _HubFamily(
            "d_fine", "DFineBackbone", _dfine_kwargs, image32, ("vision", "detector"),
        ),
        _HubFamily(
            "deeplab_v3",
            "DeepLabV3Backbone",
            lambda: dict(
                image_encoder=_resnet(filters=(64, 8, 16), blocks=(1, 1, 1), strides=(1, 2, 2)),
                low_level_feature_key="P2",
                spatial_pyramid_pooling_key="P4",
                dilation_rates=[2, 4],
                upsampling_size=4,
                projection_filters=8,
                image_shape=(64, 64, 3),
            ),
            _image(64),
            ("vision", "cnn", "detector"),
        ),
        _HubFamily(
            "depth_anything",
            "DepthAnythingBackbone",
            _depth_anything_kwargs,
            {"images": _image(126)},
            ("vision", "detector"),
        ),
        _HubFamily(
            "retinanet",
            "RetinaNetBackbone",
            lambda: dict(
                image_encoder=_resnet(), min_level=3, max_level=5, use_p5=True,
                image_shape=(64, 64, 3),
            ),
            _image(64),
            ("vision", "cnn", "detector"),
        ),
        _HubFamily(
            "sam",
            "SAMBackbone",
            _sam_kwargs,
            {
                "images": _image(32),
                "points": ("uniform", (1, 2), 32.0),
                "labels": ("ones", (1,), "float32"),
                "boxes": ("uniform", (1, 2, 2), 32.0),
                "masks": ("zeros", (0, 32, 32, 1), "float32"),
            },
            ("vision", "detector"),
            # prompt_dense_positional_embeddings has batch 1 whatever the batch: no target.
            fit_outputs=("image_embeddings", "prompt_sparse_embeddings", "prompt_dense_embeddings"),
            note="fit: loss on 3 of the 4 outputs (the positional one has batch size 1)",
        ),
        _HubFamily(
            "sam3",
            "SAM3PromptableConceptBackbone",
            _sam3_kwargs,
            {
                "pixel_values": _image(28),
                "token_ids": ("tokens", (32,)),
                "padding_mask": ("ones", (32,), "bool"),
                "boxes": ("uniform", (1, 5)),
                "box_labels": ("ones", (1,)),
            },
            ("vision", "detector", "multimodal"),
            note="TensorFlow fit needs jit_compile=False: no XLA CPU kernel for "
            "ResizeNearestNeighborGrad (pixel decoder)",
        ),
        _HubFamily(
            "segformer",
            "SegFormerBackbone",
            lambda: dict(
                image_encoder=_hub("MiTBackbone")(
                    layerwise_depths=[1, 1],
                    image_shape=(32, 32, 3),
                    hidden_dims=[8, 16],
                    num_layers=2,
                    layerwise_num_heads=[1, 2],
                    layerwise_sr_ratios=[4, 2],
                    max_drop_path_rate=0.0,
                    layerwise_patch_sizes=[7, 3],
                    layerwise_strides=[4, 2],
                ),
                projection_filters=16,
            ),
            image32,
            ("vision", "detector"),
        ),
        # --- Multimodal and generative.
        _HubFamily(
            "blip2",
            "BLIP2Backbone",
            _blip2_kwargs,
            {
                "images": _image(32),
                "token_ids": ("tokens", (_SEQ,)),
                "padding_mask": ("ones", (_SEQ,), "bool"),
            },
            ("multimodal", "vision", "decoder_lm"),
        ),
        _HubFamily(
            "clip",
            "CLIPBackbone",
            _clip_like(
                "clip",
                ("clip.clip_vision_encoder", "CLIPVisionEncoder"),
                ("clip.clip_text_encoder", "CLIPTextEncoder"),
                projection_dim=16,
            ),
            {"images": _image(32), "token_ids": ("tokens", (_SEQ,))},
            ("multimodal", "vision"),
        ),
        _HubFamily(
            "flux",
            "FluxBackbone",
            _flux_kwargs,
            {
                "image": ("normal", (8, 16)),
                "image_ids": ("zeros", (8, 3), "float32"),
                "text": ("normal", (8, 16)),
                "text_ids": ("zeros", (8, 3), "float32"),
                "y": ("normal", (16,)),
                "timesteps": ("uniform", ()),
                "guidance": ("ones", (), "float32"),
            },
            ("multimodal", "vision"),
        ),
        _HubFamily(
            "metaclip_2",
            "MetaCLIP2Backbone",
            _clip_like(
                "metaclip_2",
                ("metaclip_2.metaclip_2_vision_encoder", "MetaCLIP2VisionEncoder"),
                ("metaclip_2.metaclip_2_text_encoder", "MetaCLIP2TextEncoder"),
                projection_dim=16,
            ),
            {"images": _image(32), "token_ids": ("tokens", (_SEQ,))},
            ("multimodal", "vision"),
        ),
        _HubFamily(
            "pali_gemma",
            "PaliGemmaBackbone",
            lambda: dict(
                vocabulary_size=_VOCAB, image_size=16, num_layers=2, num_query_heads=2,
                num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8,
                vit_patch_size=4, vit_num_layers=2, vit_num_heads=2, vit_hidden_dim=16,
                vit_intermediate_dim=32,
            ),
            {
                "images": _image(16),
                "token_ids": ("tokens", (_SEQ,)),
                "padding_mask": ("ones", (_SEQ,)),
                "response_mask": ("zeros", (_SEQ,)),
            },
            ("multimodal", "vision", "decoder_lm"),
        ),
        _HubFamily(
            "parseq",
            "PARSeqBackbone",
            _parseq_kwargs,
            {
                "images": _image((16, 64)),
                "token_ids": ("tokens", (_SEQ + 1,)),  # max_label_length + 1 (with BOS)
                "padding_mask": ("ones", (_SEQ + 1,)),
            },
            ("multimodal", "vision"),
        ),
        _HubFamily(
            "siglip",
            "SigLIPBackbone",
            _clip_like(
                "siglip",
                ("siglip.siglip_vision_encoder", "SigLIPVisionEncoder"),
                ("siglip.siglip_text_encoder", "SigLIPTextEncoder"),
            ),
            {"images": _image(32), "token_ids": ("tokens", (_SEQ,))},
            ("multimodal", "vision"),
        ),
        _HubFamily(
            "stable_diffusion_3",
            "StableDiffusion3Backbone",
            _sd3_kwargs,
            {
                "images": _image(32),
                "latents": ("normal", (4, 4, 16)),
                "clip_l_token_ids": ("tokens", (5,), 20),
                "clip_l_negative_token_ids": ("tokens", (5,), 20),
                "clip_g_token_ids": ("tokens", (5,), 20),
                "clip_g_negative_token_ids": ("tokens", (5,), 20),
                "num_steps": ("ones", ()),
                "guidance_scale": ("ones", (), "float32"),
            },
            ("multimodal", "vision"),
            # The scheduler reads `num_steps` as a python value when it sets its sigmas:
            # set them eagerly, as the text-to-image task does before generating.
            post_build=lambda backbone: backbone.configure_scheduler(1),
            note="scheduler sigmas set eagerly (configure_scheduler(1)) after build",
        ),
    ]


def _hub_backbone_maker(fam: _HubFamily) -> Callable[[], keras.Model]:
    def make_backbone() -> keras.Model:
        backbone = _hub(fam.backbone)(**fam.kwargs())
        if fam.post_build is not None:
            fam.post_build(backbone)
        return backbone

    make_backbone.__doc__ = f"keras_hub.models.{fam.backbone}, tiny."
    return make_backbone


def _hub_task(
    fam: _HubFamily,
    cls_name: str,
    fit_data: Callable,
    extra: Callable[[], dict] = dict,
    **fixed: Any,
) -> Entry:
    """A keras_hub task (`preprocessor=None`) on the family's tiny backbone."""
    make_backbone = _hub_backbone_maker(fam)

    def make() -> keras.Model:
        return _hub(cls_name)(backbone=make_backbone(), preprocessor=None, **fixed, **extra())

    make.__doc__ = f"keras_hub.models.{cls_name} on a tiny {fam.backbone}."
    return Entry(
        name=f"hub.{cls_name}",
        family=fam.family,
        kind="task",
        tags=_frozen(fam.tags),
        build=_seeded(make),
        inputs=_inputs(fam.spec),
        fit_data=fit_data,
        loss=_sparse_ce,
        backends=fam.backends,
        note=fam.task_note or fam.note,
    )


def _hub_entries() -> list[Entry]:
    entries = []
    for fam in _hub_families():
        inputs = _inputs(fam.spec)
        entries.append(
            Entry(
                name=f"hub.{fam.backbone}",
                family=fam.family,
                kind="backbone",
                tags=_frozen(fam.tags),
                build=_seeded(_hub_backbone_maker(fam)),
                inputs=inputs,
                fit_data=_zeros_like_outputs(inputs, fam.fit_outputs),
                loss=_mse_for(fam.fit_outputs) if fam.fit_outputs else _mse,
                backends=fam.backends,
                note=fam.note,
            )
        )
        if fam.causal_lm:
            entries.append(_hub_task(fam, fam.causal_lm, _next_tokens(inputs)))
        if fam.text_classifier:
            entries.append(
                _hub_task(fam, fam.text_classifier, _labels(inputs, 3), num_classes=3)
            )
        if fam.image_classifier:
            entries.append(
                _hub_task(
                    fam,
                    fam.image_classifier,
                    _labels(inputs, 10),
                    fam.image_classifier_kwargs or dict,
                    num_classes=10,
                )
            )
        if fam.seq2seq:
            entries.append(
                _hub_task(fam, fam.seq2seq, _next_tokens(inputs, "decoder_token_ids"))
            )
    return entries


# ---------------------------------------------------------------------------------------
# keras.applications.

# (constructor, family, smallest input side, pixel range, extra kwargs). The pixel range
# is 255 for the models that rescale inside (include_preprocessing), else 1.
APPLICATIONS = (
    ("ConvNeXtTiny", "convnext", 32, 255, {}),
    ("ConvNeXtSmall", "convnext", 32, 255, {}),
    ("ConvNeXtBase", "convnext", 32, 255, {}),
    ("ConvNeXtLarge", "convnext", 32, 255, {}),
    ("ConvNeXtXLarge", "convnext", 32, 255, {}),
    ("DenseNet121", "densenet", 32, 1, {}),
    ("DenseNet169", "densenet", 32, 1, {}),
    ("DenseNet201", "densenet", 32, 1, {}),
    ("EfficientNetB0", "efficientnet", 32, 255, {}),
    ("EfficientNetB1", "efficientnet", 32, 255, {}),
    ("EfficientNetB2", "efficientnet", 32, 255, {}),
    ("EfficientNetB3", "efficientnet", 32, 255, {}),
    ("EfficientNetB4", "efficientnet", 32, 255, {}),
    ("EfficientNetB5", "efficientnet", 32, 255, {}),
    ("EfficientNetB6", "efficientnet", 32, 255, {}),
    ("EfficientNetB7", "efficientnet", 32, 255, {}),
    ("EfficientNetV2B0", "efficientnetv2", 32, 255, {}),
    ("EfficientNetV2B1", "efficientnetv2", 32, 255, {}),
    ("EfficientNetV2B2", "efficientnetv2", 32, 255, {}),
    ("EfficientNetV2B3", "efficientnetv2", 32, 255, {}),
    ("EfficientNetV2S", "efficientnetv2", 32, 255, {}),
    ("EfficientNetV2M", "efficientnetv2", 32, 255, {}),
    ("EfficientNetV2L", "efficientnetv2", 32, 255, {}),
    ("InceptionResNetV2", "inception_resnet_v2", 75, 1, {}),
    ("InceptionV3", "inception_v3", 75, 1, {}),
    ("MobileNet", "mobilenet", 32, 1, {"alpha": 0.25}),
    ("MobileNetV2", "mobilenetv2", 32, 1, {"alpha": 0.35}),
    ("MobileNetV3Small", "mobilenetv3", 32, 255, {"alpha": 0.75}),
    ("MobileNetV3Large", "mobilenetv3", 32, 255, {"alpha": 0.75}),
    ("NASNetMobile", "nasnet", 32, 1, {}),
    ("NASNetLarge", "nasnet", 32, 1, {}),
    ("ResNet50", "resnet", 32, 1, {}),
    ("ResNet101", "resnet", 32, 1, {}),
    ("ResNet152", "resnet", 32, 1, {}),
    ("ResNet50V2", "resnetv2", 32, 1, {}),
    ("ResNet101V2", "resnetv2", 32, 1, {}),
    ("ResNet152V2", "resnetv2", 32, 1, {}),
    ("VGG16", "vgg", 32, 1, {}),
    ("VGG19", "vgg", 32, 1, {}),
    ("Xception", "xception", 71, 1, {}),
)
_APPS_CORE = {"MobileNetV2", "MobileNetV3Small"}


def _apps_entries() -> list[Entry]:
    entries = []
    for constructor, family, side, pixel_range, extra in APPLICATIONS:
        inputs = _inputs(_image(side, high=float(pixel_range)))

        def make(constructor=constructor, side=side, extra=extra) -> keras.Model:
            return getattr(keras.applications, constructor)(
                weights=None,
                input_shape=(side, side, 3),
                classes=10,
                classifier_activation=None,
                **extra,
            )

        make.__doc__ = f"keras.applications.{constructor}(weights=None), {side}x{side}."
        tags = {"vision", "cnn"} | ({"core"} if constructor in _APPS_CORE else set())
        entries.append(
            Entry(
                name=f"apps.{constructor}",
                family=family,
                kind="application",
                tags=_frozen(tags),
                build=_seeded(make),
                inputs=inputs,
                fit_data=_labels(inputs, 10),
                loss=_sparse_ce,
            )
        )
    return entries


# ---------------------------------------------------------------------------------------
# User models.


@keras.saving.register_keras_serializable(package="kmp_zoo")
class ZooSubclassedMLP(keras.Model):
    """A subclassed model with a complete `get_config` (saveable).

    Args:
        units: width of the hidden layers.
        num_classes: number of logits.
    """

    def __init__(self, units: int = 32, num_classes: int = 10, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units
        self.num_classes = num_classes
        self.hidden = keras.layers.Dense(units, activation="relu", name="hidden")
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.logits = keras.layers.Dense(num_classes, name="logits")

    def build(self, input_shape: tuple) -> None:
        self.hidden.build(input_shape)
        hidden_shape = (*input_shape[:-1], self.units)
        self.norm.build(hidden_shape)
        self.logits.build(hidden_shape)

    def call(self, inputs: Any) -> Any:
        return self.logits(self.norm(self.hidden(inputs)))

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(units=self.units, num_classes=self.num_classes)
        return config


class _Settings:
    """A plain python object: not serializable, so `ZooOpaqueModel` has no usable config."""

    def __init__(self, units: int, scale: float) -> None:
        self.units = units
        self.scale = scale


class ZooOpaqueModel(keras.Model):
    """A subclassed model WITHOUT a usable `get_config`: its constructor takes a layer
    instance and a plain python object (not registered, not saveable as a config).

    Args:
        head: the output layer (a layer instance).
        settings: a `_Settings` (plain python object).
    """

    def __init__(self, head: keras.layers.Layer, settings: _Settings, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.settings = settings
        self.body = keras.layers.Dense(settings.units, activation="gelu", name="body")
        self.norm = keras.layers.BatchNormalization(name="norm")
        self.head = head

    def build(self, input_shape: tuple) -> None:
        self.body.build(input_shape)
        hidden_shape = (*input_shape[:-1], self.settings.units)
        self.norm.build(hidden_shape)
        self.head.build(hidden_shape)

    def call(self, inputs: Any, training: bool = False) -> Any:
        hidden = self.norm(self.body(inputs), training=training)
        return self.head(hidden * self.settings.scale)


@keras.saving.register_keras_serializable(package="kmp_zoo")
class ZooTwinKernel(keras.layers.Layer):
    """A layer with two variables of the same shape (`x @ a + relu(x @ b)`), to test that
    weights are matched by path and not by shape or creation order.

    Args:
        units: output width (both kernels are `(input_dim, units)`).
    """

    def __init__(self, units: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: tuple) -> None:
        shape = (input_shape[-1], self.units)
        self.a = self.add_weight(shape=shape, initializer="glorot_uniform", name="a")
        self.b = self.add_weight(shape=shape, initializer="glorot_uniform", name="b")

    def call(self, inputs: Any) -> Any:
        ops = keras.ops
        return ops.matmul(inputs, self.a) + ops.relu(ops.matmul(inputs, self.b))

    def compute_output_shape(self, input_shape: tuple) -> tuple:
        return (*input_shape[:-1], self.units)

    def get_config(self) -> dict:
        config = super().get_config()
        config["units"] = self.units
        return config


def _functional_mlp() -> keras.Model:
    inputs = keras.Input((16,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="dense_2")(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x), name="functional_mlp")


def _sequential_cnn() -> keras.Model:
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            layers.Conv2D(8, 3, padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 3, padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.GlobalAveragePooling2D(),
            layers.Dense(10, name="logits"),
        ],
        name="sequential_cnn",
    )


def _transformer_block() -> keras.Model:
    layers = keras.layers
    tokens = keras.Input((_SEQ,), dtype="int32", name="token_ids")
    x = layers.Embedding(_VOCAB, 16, name="embedding")(tokens)
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=8, name="attention")(x, x)
    x = layers.LayerNormalization(name="ln_1")(x + attention)
    hidden = layers.Dense(32, activation="gelu", name="ffn_in")(x)
    x = layers.LayerNormalization(name="ln_2")(x + layers.Dense(16, name="ffn_out")(hidden))
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, layers.Dense(3, name="logits")(x), name="transformer_block")


def _subclassed_with_config() -> keras.Model:
    model = ZooSubclassedMLP(units=32, num_classes=10, name="subclassed_mlp")
    model.build((None, 16))
    return model


def _subclassed_without_config() -> keras.Model:
    head = keras.layers.Dense(10, name="head")
    model = ZooOpaqueModel(head, _Settings(units=32, scale=0.5), name="opaque_model")
    model.build((None, 16))
    return model


def _nested_functional() -> keras.Model:
    inner_in = keras.Input((16,), name="inner_in")
    h = keras.layers.Dense(32, activation="relu", name="inner_dense")(inner_in)
    h = keras.layers.LayerNormalization(name="inner_norm")(h)
    inner = keras.Model(inner_in, keras.layers.Dense(16, name="inner_out")(h), name="inner")
    inputs = keras.Input((16,), name="features")
    x = keras.layers.Dense(16, activation="relu", name="stem")(inputs)
    x = inner(x)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x), name="nested")


def _shared_layer() -> keras.Model:
    inputs = keras.Input((16,), name="features")
    shared = keras.layers.Dense(16, activation="relu", name="shared")
    x = shared(shared(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x), name="shared_layer")


def _rnn_classifier() -> keras.Model:
    layers = keras.layers
    tokens = keras.Input((_SEQ,), dtype="int32", name="token_ids")
    x = layers.Embedding(_VOCAB, 16, mask_zero=True, name="embedding")(tokens)
    x = layers.LSTM(16, return_sequences=True, name="lstm")(x)
    x = layers.GRU(16, name="gru")(x)
    return keras.Model(tokens, layers.Dense(3, name="logits")(x), name="rnn_classifier")


def _conv1d() -> keras.Model:
    layers = keras.layers
    inputs = keras.Input((32, 4), name="signal")
    x = layers.Conv1D(16, 3, padding="same", activation="relu", name="conv_1")(inputs)
    x = layers.LayerNormalization(name="norm")(x)
    x = layers.Conv1D(16, 3, dilation_rate=2, padding="causal", activation="relu",
                      name="conv_2")(x)
    x = layers.GlobalMaxPooling1D()(x)
    return keras.Model(inputs, layers.Dense(10, name="logits")(x), name="conv1d")


def _twin_variables() -> keras.Model:
    inputs = keras.Input((16,), name="features")
    x = ZooTwinKernel(16, name="twin")(inputs)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(x), name="twin_variables")


def _user_entries() -> list[Entry]:
    features = ("normal", (16,))
    tokens = ("tokens", (_SEQ,))
    table = (
        # name, make, input spec, classes, tags
        ("FunctionalMLP", _functional_mlp, features, 10, ()),
        ("SequentialCNN", _sequential_cnn, _image(16), 10, ("vision", "cnn")),
        ("TransformerBlock", _transformer_block, tokens, 3, ("encoder",)),
        ("Subclassed", _subclassed_with_config, features, 10, ()),
        ("SubclassedNoConfig", _subclassed_without_config, features, 10, ("core",)),
        ("Nested", _nested_functional, features, 10, ("core",)),
        ("SharedLayer", _shared_layer, features, 10, ("core",)),
        ("RNNClassifier", _rnn_classifier, tokens, 3, ("rnn",)),
        ("Conv1D", _conv1d, ("normal", (32, 4)), 10, ("cnn",)),
        ("TwinVariables", _twin_variables, features, 10, ("core",)),
    )
    entries = []
    for name, make, spec, classes, tags in table:
        inputs = _inputs(spec)
        entries.append(
            Entry(
                name=f"user.{name}",
                family="user",
                kind="user",
                tags=_frozen(tags),
                build=_seeded(make),
                inputs=inputs,
                fit_data=_labels(inputs, classes),
                loss=_sparse_ce,
            )
        )
    return entries


# ---------------------------------------------------------------------------------------
# The registry.

# keras_hub entries in the default, fast CI subset.
_HUB_CORE = {
    "hub.BertBackbone",  # encoder
    "hub.GPT2CausalLM",  # decoder LM task
    "hub.Qwen3Backbone",  # RoPE decoder, GQA, q/k norm
    "hub.ESMBackbone",  # rotary encoder
    "hub.ViTBackbone",  # vision transformer
    "hub.ResNetBackbone",  # keras_hub CNN
}


def _with_core(entry: Entry) -> Entry:
    if entry.name in _HUB_CORE:
        return dataclasses.replace(entry, tags=entry.tags | {"core"})
    return entry


def _all_entries() -> tuple[Entry, ...]:
    entries = [_with_core(e) for e in _hub_entries()] + _apps_entries() + _user_entries()
    names = [e.name for e in entries]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Duplicate zoo names: {duplicates}")
    return tuple(entries)


ENTRIES: tuple[Entry, ...] = _all_entries()
_BY_NAME = {e.name: e for e in ENTRIES}


def get(name: str) -> Entry:
    """The entry called `name` (e.g. "hub.GPT2CausalLM"); `KeyError` if there is none."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"No zoo entry {name!r}") from None


def select(
    tags: str | Iterable[str] | None = None,
    kind: str | Iterable[str] | None = None,
    names: Iterable[str] | None = None,
    backend: str | None = None,
) -> list[Entry]:
    """Entries matching every given filter, in registry order.

    Args:
        tags: keep entries that have ANY of these tags (or this one tag).
        kind: keep entries of this kind (or of any of these kinds).
        names: keep entries with these names (unknown names raise `KeyError`).
        backend: keep entries expected to run on this backend.
    """
    selected = list(ENTRIES)
    if names is not None:
        wanted = [get(n).name for n in names]
        selected = [e for e in selected if e.name in wanted]
    if tags is not None:
        tags = _frozen([tags] if isinstance(tags, str) else tags)
        selected = [e for e in selected if e.tags & tags]
    if kind is not None:
        kinds = {kind} if isinstance(kind, str) else set(kind)
        selected = [e for e in selected if e.kind in kinds]
    if backend is not None:
        selected = [e for e in selected if backend in e.backends]
    return selected
