"""Float8 layers on Keras' own float8 path, and `apply_float8`, which makes a model's matmuls FP8.

Keras trains `Dense` and `EinsumDense` in FP8 after `layer.quantize("float8")`: the inputs
and the kernel are quantized to E4M3, the output gradient to E5M2, each with a per-tensor
scale derived from a window (history) of recent absolute maxima. The scales and histories
are layer variables that the optimizer overwrites with the values the custom gradient
returns, so they are saved, restored and synchronised like weights.

The layers here run a `Float8Recipe` (`keras_mp.float8.recipe`): `Float8Dense`,
`Float8EinsumDense`, and attention layers whose projections run it. `apply_float8(model)`
turns a built model's matmul layers into FP8 in place. Without FP8 tensor cores the
quantize-dequantize runs emulated: the numerics are those of FP8, the speed is not (see
`float8_speedup_expected`).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
from keras import ops
from keras.dtype_policies import DTypePolicyMap

import keras_mp.numerics.layers as kmp_layers
from keras_mp.float8.payoff import float8_layers
from keras_mp.float8.recipe import (
    _TENSORS,
    Float8DTypePolicy,
    Float8Recipe,
    _scale,
    as_recipe,
)
from keras_mp.keep_list import output_layers

__all__ = [
    "Float8Dense",
    "Float8EinsumDense",
    "Float8MultiHeadAttention",
    "Float8SoftmaxMultiHeadAttention",
    "apply_float8",
    "float8_state",
]


def _recipe_of(layer) -> Float8Recipe:
    """The recipe a float8 layer runs (Keras' defaults for a stock float8 policy)."""
    policy = layer.dtype_policy
    if isinstance(policy, DTypePolicyMap) and layer.path:
        policy = policy[layer.path]
    recipe = getattr(policy, "recipe", None)
    if recipe is None:  # stock QuantizedFloat8DTypePolicy: max over its window, HYBRID
        return Float8Recipe(amax_history_len=int(layer.inputs_amax_history.shape[0]))
    return recipe


def _with_variables(grads, variables):
    """TF eager also wants gradients for variables read under the tape (stock Keras fails
    there): the variables' values reach these functions as the inputs, which carry them."""
    return (grads, [None] * len(variables)) if variables else grads


def _float8_matmul(layer, inputs, training, contract):
    """Keras' `_float8_call` with the recipe's scale rule and formats (see module doc)."""
    if layer.lora_enabled:
        raise NotImplementedError(f"Layer {layer.name!r}: float8 training doesn't support LoRA.")
    recipe, dtype = _recipe_of(layer), layer.compute_dtype

    def new_scale_inv(history, scale_inv, fp8_dtype):  # Keras' variables hold 1 / scale
        scale, ok = _scale(history, recipe, fp8_dtype)
        return ops.where(ok, ops.reciprocal(scale), scale_inv)

    @ops.custom_gradient
    def qdq_forward(x, scale_inv, history):
        fp8 = "float8_e4m3fn"
        new_history = new_scale = None
        if training:
            new_history = keras.quantizers.compute_float8_amax_history(x, history)
            new_scale = new_scale_inv(new_history, scale_inv, fp8)

        def grad(*args, upstream=None, variables=None):
            grads = (args[0] if upstream is None else upstream), new_scale, new_history
            return _with_variables(grads, variables)

        return keras.quantizers.quantize_and_dequantize(x, scale_inv, fp8, dtype), grad

    @ops.custom_gradient
    def qdq_backward(x, scale_inv, history):
        fp8 = recipe.gradient_dtype

        def grad(*args, upstream=None, variables=None):
            upstream = args[0] if upstream is None else upstream
            new_history = keras.quantizers.compute_float8_amax_history(upstream, history)
            qdq = keras.quantizers.quantize_and_dequantize(upstream, scale_inv, fp8, dtype)
            grads = qdq, new_scale_inv(new_history, scale_inv, fp8), new_history
            return _with_variables(grads, variables)

        return x, grad

    def var(name):
        return ops.convert_to_tensor(getattr(layer, name))

    x = contract(
        qdq_forward(inputs, var("inputs_scale"), var("inputs_amax_history")),
        qdq_forward(var("_kernel"), var("kernel_scale"), var("kernel_amax_history")),
    )
    # Right after the matmul, as in Keras, so that XLA fuses the qdq pairs into FP8 GEMMs.
    x = qdq_backward(x, var("outputs_grad_scale"), var("outputs_grad_amax_history"))
    if layer.bias is not None:
        x = ops.add(x, layer.bias)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


def _quantized_call(layer, stock, inputs, training):
    """The float8 mode runs the recipe's `_float8_call`; other modes stay Keras'. Keras up to
    3.15 dispatched to `_float8_call` itself; 3.16 runs a registered strategy instead
    (`keras.src.quantizers.modes.float8`), which would silently replace the recipe."""
    if layer.quantization_mode == "float8":
        return layer._float8_call(inputs, training=training)
    return stock(inputs, training=training)


@keras.saving.register_keras_serializable(package="keras_mp")
class Float8Dense(keras.layers.Dense):
    """`keras.layers.Dense` whose float8 mode follows the `Float8Recipe` of its policy.

    Same arguments and weights as `Dense`; give it a `Float8DTypePolicy` (or let
    `apply_float8` convert a built `Dense`).
    """

    def _float8_call(self, inputs, training=None):
        return _float8_matmul(self, inputs, training, ops.matmul)

    def quantized_call(self, inputs, training=None):
        return _quantized_call(self, super().quantized_call, inputs, training)

    def quantize(self, mode=None, type_check=True, config=None):
        return super().quantize(mode, type_check=False, config=config)


@keras.saving.register_keras_serializable(package="keras_mp")
class Float8EinsumDense(keras.layers.EinsumDense):
    """`keras.layers.EinsumDense` whose float8 mode follows the `Float8Recipe` of its policy."""

    def _float8_call(self, inputs, training=None):
        return _float8_matmul(self, inputs, training, lambda a, b: ops.einsum(self.equation, a, b))

    def quantized_call(self, inputs, training=None):
        return _quantized_call(self, super().quantized_call, inputs, training)

    def quantize(self, mode=None, type_check=True, config=None):
        return super().quantize(mode, type_check=False, config=config)


_FP8_CLASSES = {keras.layers.Dense: Float8Dense, keras.layers.EinsumDense: Float8EinsumDense}


def _to_float8(layer, recipe: Float8Recipe) -> None:
    """Quantizes a built stock `Dense`/`EinsumDense` to float8 under `recipe`, in place."""
    source = layer.dtype_policy
    if isinstance(source, DTypePolicyMap):
        # Keras' quantize() reads the policy's name, which a map does not have: the layer
        # gets its own plain policy (its config saves it).
        source = source[layer.path]
        layer._dtype_policy = keras.DTypePolicy(source.name)
    layer.dtype_policy = Float8DTypePolicy(recipe, source.name)  # runs layer.quantize("float8")
    # Same state, Keras' `_float8_call` replaced by the recipe's; saved under this class.
    layer.__class__ = _FP8_CLASSES[type(layer)]
    # The kernel is known now: start its history (and scale) from its amax, not from 1.0.
    kernel_amax = ops.reshape(ops.max(ops.abs(layer.kernel)), [1])
    history = ops.scatter_update(ops.zeros((recipe.amax_history_len,)), [[0]], kernel_amax)
    scale, ok = _scale(history, recipe, "float8_e4m3fn")
    if bool(ok):
        layer.kernel_amax_history.assign(history)
        layer.kernel_scale.assign(ops.reciprocal(scale))


class _Float8AttentionMixin:
    """Attention whose projection `EinsumDense` layers (listed by name) run float8."""

    def __init__(self, *args, float8_recipe=None, float8_projections=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.float8_recipe = as_recipe(float8_recipe)
        self.float8_projections = tuple(float8_projections)

    def build(self, *args, **kwargs):
        super().build(*args, **kwargs)
        for sub in self._layers:
            if sub.name in self.float8_projections and sub.quantization_mode is None:
                _to_float8(sub, self.float8_recipe)

    def get_config(self) -> dict:
        config = super().get_config()
        config["float8_recipe"] = self.float8_recipe.get_config()
        config["float8_projections"] = list(self.float8_projections)
        return config


@keras.saving.register_keras_serializable(package="keras_mp")
class Float8MultiHeadAttention(_Float8AttentionMixin, keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with FP8 projections (see `apply_float8`).

    Args:
        float8_recipe: A `Float8Recipe` or its config dict.
        float8_projections: Names of the projections that run FP8 (`"query"`, `"key"`,
            `"value"`, `"attention_output"`, `"gate"`).
        **kwargs: The arguments of `keras.layers.MultiHeadAttention`.
    """


@keras.saving.register_keras_serializable(package="keras_mp")
class Float8SoftmaxMultiHeadAttention(_Float8AttentionMixin, kmp_layers.MultiHeadAttention):
    """`keras_mp.layers.MultiHeadAttention` (FP32 softmax) with FP8 projections.

    Args: as `Float8MultiHeadAttention`.
    """


_ATTENTION_CLASSES = {
    keras.layers.MultiHeadAttention: Float8MultiHeadAttention,
    kmp_layers.MultiHeadAttention: Float8SoftmaxMultiHeadAttention,
}


def apply_float8(
    model: keras.Model,
    recipe: Float8Recipe | None = None,
    exclude: Callable[[keras.layers.Layer], bool] | None = None,
    include_outputs: bool = False,
) -> keras.Model:
    """Makes a built model's `Dense` and `EinsumDense` layers train in FP8, in place.

    Every `keras.layers.Dense` and `keras.layers.EinsumDense` (exact classes, nested ones
    included, and the projections of `keras.layers.MultiHeadAttention` and
    `keras_mp.layers.MultiHeadAttention`) is quantized to float8 under `recipe`. Left as
    they are: the layers producing the model's outputs unless `include_outputs` (the logits
    projection keeps its bfloat16 matmul, as in Transformer Engine recipes: FP8 rounding of
    the logits costs accuracy for little speed), layers computing in float32 inside a model
    that does not (the FP32 keep-list), layers for which `exclude(layer)` is true, and layers
    already quantized. Everything else keeps its policy: call this on a model already under
    `"mixed_bfloat16"` with the keep-list applied (`kmp.convert`).

    The weights are kept; FP8 scales and amax histories are added (the kernel's from its
    current amax, the others 1.0 and zeros until the first step). Call it before
    `compile`/`fit`. The result round-trips through `.keras` files for Functional and
    Sequential models; layers that a subclassed model's `__init__` recreates as stock
    layers won't load their FP8 state, and subclasses of `MultiHeadAttention` are skipped.

    Args:
        model: A built `keras.Model`.
        recipe: A `Float8Recipe` (default `Float8Recipe()`).
        exclude: Optional predicate; layers (and attention projections) for which it
            returns True stay as they are.
        include_outputs: Also quantize the layers producing `model.outputs`.

    Returns:
        `model`, now with FP8 matmuls.

    Example:

    ```python
    model = kmp.convert(model, "mixed_bfloat16")
    kmp.float8.apply_float8(model, kmp.float8.Float8Recipe(amax_history_len=16),
                            exclude=lambda layer: layer.name.startswith("head"))
    ```
    """
    recipe = as_recipe(recipe)
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(f"apply_float8 takes a built keras.Model. Received: {model!r}")
    if exclude is not None and not callable(exclude):
        raise ValueError(f"`exclude` must be a callable (layer -> bool) or None. Got {exclude!r}.")
    if getattr(model, "optimizer", None) is not None and model.optimizer.built:
        raise ValueError(
            f"apply_float8: model {model.name!r} has a built optimizer; apply FP8 before "
            "training so the optimizer tracks the FP8 scale variables (or compile again)."
        )
    model_fp32 = model.compute_dtype == "float32"
    heads = frozenset() if include_outputs else frozenset(id(x) for x in output_layers(model))

    def wanted(layer):
        pinned = (layer.compute_dtype == "float32" and not model_fp32) or id(layer) in heads
        return not pinned and not (exclude and exclude(layer)) and layer.quantization_mode is None

    layers = list(model._flatten_layers(include_self=False))
    in_attention = {
        id(s)
        for x in layers
        if isinstance(x, keras.layers.MultiHeadAttention)
        for s in x._flatten_layers(include_self=False)
    }
    for layer in layers:
        if not layer.built or not wanted(layer):
            continue
        if type(layer) in _ATTENTION_CLASSES:
            names = tuple(
                s.name for s in layer._layers if type(s) is keras.layers.EinsumDense and wanted(s)
            )
            if not names:
                continue
            for sub in layer._layers:
                if sub.name in names:
                    _to_float8(sub, recipe)
            layer.__class__ = _ATTENTION_CLASSES[type(layer)]
            layer.float8_recipe, layer.float8_projections = recipe, names
        elif type(layer) in _FP8_CLASSES and id(layer) not in in_attention:
            _to_float8(layer, recipe)
    return model


def float8_state(model: keras.Model) -> dict:
    """The current FP8 scales and amaxes of every float8 layer, for audits.

    Args:
        model: A Keras model.

    Returns:
        `{layer.path: {"recipe": Float8Recipe, "inputs" | "kernel" | "outputs_grad":
        {"dtype", "scale", "scale_inv", "amax", "amax_history"}}}`. `scale` follows
        `compute_scale` (multiply before the cast), `scale_inv` is the stored variable,
        `amax` the recipe's amax over the stored history (newest first, numpy array).
    """
    out = {}
    for layer in float8_layers(model):
        recipe = _recipe_of(layer)
        entry = {"recipe": recipe}
        for t in _TENSORS:
            scale_inv = float(np.asarray(getattr(layer, f"{t}_scale").numpy()))
            history = np.asarray(getattr(layer, f"{t}_amax_history").numpy())
            amax = history.max() if recipe.amax_compute_algo == "max" else history[0]
            entry[t] = {
                "dtype": recipe.gradient_dtype if t == "outputs_grad" else "float8_e4m3fn",
                "scale": 1.0 / scale_inv,
                "scale_inv": scale_inv,
                "amax": float(amax),
                "amax_history": history,
            }
        out[layer.path] = entry
    return out
