"""Layers that keep numerically sensitive computations in float32 inside mixed models.

* `Float32(layer)` runs any layer in float32: float32 variables, inputs up-cast, output cast
  back to the surrounding compute dtype (or kept float32 on request).
* `Softmax` is `keras.layers.Softmax` computed in float32. Under `"mixed_float16"` the stock
  layer exponentiates and sums in float16: over thousands of positions the small
  probabilities lose most of their digits and the sum is rounded at every step.
* `MultiHeadAttention` is `keras.layers.MultiHeadAttention` whose explicit attention softmax
  (used with dropout, with `return_attention_scores=True` or with more than one attention
  axis) runs in float32, with probabilities cast back to the compute dtype for the value
  matmul. The fused `ops.dot_product_attention` path that Keras takes otherwise is kept
  unchanged: its TensorFlow and JAX implementations already take the softmax in float32.
* `LayerNormalization` is `keras.layers.LayerNormalization` (float32 statistics already)
  with a fused TensorFlow kernel for float16/bfloat16 inputs: forward and backward as one
  XLA cluster each, less kept for the backward pass.

Example:

```python
import keras, keras_mp as kmp

keras.config.set_dtype_policy("mixed_float16")
inputs = keras.Input((128, 64))
x = kmp.layers.MultiHeadAttention(num_heads=4, key_dim=16)(inputs, inputs)
x = kmp.layers.Float32(keras.layers.LayerNormalization())(x)   # float32 inside, float16 out
logits = kmp.layers.Float32(keras.layers.Dense(10), output_dtype="float32")(x)
```
"""

from __future__ import annotations

import functools

import keras
from keras import ops

__all__ = ["Float32", "LayerNormalization", "MultiHeadAttention", "Softmax"]

_FLOAT32 = "float32"
_OUTPUT_DTYPES = (None, _FLOAT32)


def _cast_floats(structure, dtype: str):
    """Casts every floating tensor in a nested structure to `dtype`."""

    def cast(x):
        if x is not None and hasattr(x, "dtype") and keras.backend.is_float_dtype(x.dtype):
            return ops.cast(x, dtype)
        return x

    return keras.tree.map_structure(cast, structure)


@keras.saving.register_keras_serializable(package="keras_mp")
class Float32(keras.layers.Wrapper):
    """Runs any layer in float32 inside a mixed-precision model.

    The wrapped layer gets the `"float32"` dtype policy (so its variables and computation
    are float32), floating inputs are up-cast to float32 (Keras masks are kept), and
    floating outputs are cast to this wrapper's compute dtype, i.e. the surrounding
    policy's (`float16` under `"mixed_float16"`), unless `output_dtype="float32"`.
    The wrapped layer's weights are the wrapper's weights; the wrapper serializes the
    wrapped layer inside its own config, so `.keras` files load without `custom_objects`
    once `keras_mp` is imported.

    Args:
        layer: The `keras.layers.Layer` to run in float32. It must not be built yet
            with non-float32 variables (wrap layers before building them).
        output_dtype: `None` (default) to cast outputs to the wrapper's compute dtype,
            or `"float32"` to return them in float32 (e.g. for the logits layer).
        **kwargs: Base layer keyword arguments (`name`, `dtype`, ...). `dtype` sets the
            surrounding policy that decides the output dtype.

    Returns:
        Calling the wrapper returns the wrapped layer's outputs, floating ones in the
        output dtype described above.

    Example:

    ```python
    keras.config.set_dtype_policy("mixed_float16")
    norm = kmp.layers.Float32(keras.layers.LayerNormalization())
    norm(keras.ops.ones((2, 8), "float16")).dtype        # float16, statistics in float32
    ```
    """

    def __init__(self, layer: keras.layers.Layer, output_dtype: str | None = None, **kwargs):
        if output_dtype is not None:
            output_dtype = keras.backend.standardize_dtype(output_dtype)
        if output_dtype not in _OUTPUT_DTYPES:
            raise ValueError(
                f"Float32: invalid output_dtype={output_dtype!r}. Valid choices: None "
                "(the wrapper's compute dtype) or 'float32'."
            )
        if not isinstance(layer, keras.layers.Layer):
            raise ValueError(
                f"Float32: argument `layer` must be a keras.layers.Layer. Received: {layer!r}"
            )
        if layer.built:
            low = sorted(
                {
                    v.dtype
                    for v in layer.weights
                    if keras.backend.is_float_dtype(v.dtype) and v.dtype != _FLOAT32
                }
            )
            if low:
                raise ValueError(
                    f"Float32: layer '{layer.name}' is already built with {low} variables; "
                    "wrap it before it is built (or rebuild it from its config) so its "
                    "variables are created in float32."
                )
        for sublayer in layer._flatten_layers(include_self=True):
            sublayer.dtype_policy = _FLOAT32
        super().__init__(layer, **kwargs)
        self.output_dtype = output_dtype
        self.supports_masking = layer.supports_masking

    @property
    def input_dtype(self) -> str:
        """Floating inputs are converted to float32 before `call` (masks are kept)."""
        return _FLOAT32

    def build(self, input_shape=None):
        try:
            # Wrapper.build builds the wrapped layer; the name scope (entered once, also
            # when loading a saved model) gives its variables paths like "float32/dense/...".
            with keras.name_scope(self.name, caller=self):
                super().build(input_shape)
        except TypeError:
            # The wrapped layer's build needs more than one shape (e.g. attention's query
            # and value); it builds itself when the wrapper first calls it.
            pass
        self.built = True

    def __call__(self, inputs, *args, **kwargs):
        # Keras before 3.13 drops a tensor's mask when it casts the inputs to float32: the
        # mask is handed on explicitly, so the wrapped layer and the layers after it get it.
        if "mask" not in kwargs:
            from keras_mp.keras_glue.keras_internals import get_keras_mask

            mask = keras.tree.map_structure(get_keras_mask, inputs)
            if any(m is not None for m in keras.tree.flatten(mask)):
                kwargs["mask"] = mask
        return super().__call__(inputs, *args, **kwargs)

    def call(self, inputs, *args, **kwargs):
        if "mask" in kwargs and "mask" not in self.layer.call_signature_parameters:
            kwargs.pop("mask")  # e.g. Float32(Dense)(x, mask=m): Dense.call takes no mask
        outputs = self.layer(inputs, *args, **kwargs)
        return _cast_floats(outputs, self.output_dtype or self.compute_dtype)

    def compute_mask(self, inputs, previous_mask=None):
        return self.layer.compute_mask(inputs, previous_mask)

    def get_config(self) -> dict:
        config = super().get_config()
        # Let `build` rebuild the wrapped layer on load (in this wrapper's name scope, so
        # variable paths match the saved model's) instead of deserialization building it.
        config["layer"] = {k: v for k, v in config["layer"].items() if k != "build_config"}
        config["output_dtype"] = self.output_dtype
        return config


@keras.saving.register_keras_serializable(package="keras_mp")
class Softmax(keras.layers.Softmax):
    """`keras.layers.Softmax` computed in float32, returned in the compute dtype.

    Inputs are up-cast to float32, masked positions are set to -1e9 in float32, the
    softmax is taken in float32 (positions of a fully masked row are all zero, never NaN),
    and the result is cast to the layer's compute dtype (`float16` under
    `"mixed_float16"`, `float32` under a float32 policy).

    Args:
        axis: Integer, or list of integers, axis along which the softmax normalization
            is applied.
        **kwargs: Base layer keyword arguments, such as `name` and `dtype`.

    Call arguments:
        inputs: The logits.
        mask: Optional boolean mask broadcastable to `inputs`; `True` (or > 0.5) keeps.

    Returns:
        Probabilities with the shape of `inputs`, in the layer's compute dtype.

    Example:

    ```python
    keras.config.set_dtype_policy("mixed_float16")
    probs = kmp.layers.Softmax()(scores)      # float16 output, float32 arithmetic
    ```
    """

    @property
    def input_dtype(self) -> str:
        """Floating inputs are converted to float32 before `call`."""
        return _FLOAT32

    def call(self, inputs, mask=None):
        # Keras' softmax in float32; its mask value for float32 inputs is -1e9.
        outputs = super().call(ops.cast(inputs, _FLOAT32), mask=mask)
        return ops.cast(outputs, self.compute_dtype)


@keras.saving.register_keras_serializable(package="keras_mp")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` with the attention softmax in float32.

    Same constructor arguments, weights and config as the Keras layer, so a stock layer
    can be rebuilt as this one with `from_config(stock.get_config())` and
    `set_weights(stock.get_weights())`.

    When Keras computes the attention explicitly (dropout > 0,
    `return_attention_scores=True`, or several attention axes), the scores are
    normalised by `keras_mp.layers.Softmax` (float32 arithmetic, probabilities cast back
    to the compute dtype for dropout and the value matmul). Otherwise Keras calls the
    fused `keras.ops.dot_product_attention`, which is kept: it already takes the softmax
    in float32 on TensorFlow and JAX (and uses cuDNN/flash kernels where available).

    Args:
        num_heads: Number of attention heads.
        key_dim: Size of each attention head for query and key.
        **kwargs: Every other argument of `keras.layers.MultiHeadAttention`
            (`value_dim`, `dropout`, `use_bias`, `output_shape`, `attention_axes`,
            `flash_attention`, initializers, regularizers, ...).

    Returns:
        As `keras.layers.MultiHeadAttention`: the attention output, and with
        `return_attention_scores=True` the probabilities in the compute dtype.

    Example:

    ```python
    mha = kmp.layers.MultiHeadAttention(num_heads=8, key_dim=64)
    y = mha(x, x, use_causal_mask=True)
    ```
    """

    def rematerialized_call(self, layer_call, *args, **kwargs):
        """Under a `keras.RematScope` that names this layer, its call recomputed in the
        backward pass. Keras' JAX `remat` is `jax.checkpoint`, which traces every argument:
        the Python flags of this call (`use_causal_mask`, `training`,
        `return_attention_scores`) became tracers and the call failed. They are bound
        before the checkpoint; only tensors pass through it."""
        call = super().rematerialized_call(layer_call, *args, **kwargs)
        if call is layer_call or keras.backend.backend() != "jax":
            return call

        def checkpointed(*a, **kw):
            static = {k: v for k, v in kw.items() if v is None or isinstance(v, (bool, int))}
            tensors = {k: v for k, v in kw.items() if k not in static}
            bound = functools.partial(layer_call, **static)
            return keras.remat(bound)(*a, **tensors)

        return checkpointed

    def _build_attention(self, rank):
        super()._build_attention(rank)
        stock_softmax = self._softmax
        # Forget Keras' float16-capable softmax so layer walks (audits, `convert`) see ours.
        self._tracker.untrack(stock_softmax)
        self._softmax = Softmax(
            axis=stock_softmax.axis, dtype=self.dtype_policy, name=stock_softmax.name
        )


@keras.saving.register_keras_serializable(package="keras_mp")
class LayerNormalization(keras.layers.LayerNormalization):
    """`keras.layers.LayerNormalization` with a fused TensorFlow kernel for low precision.

    Same arguments, weights, config and math as the Keras layer (float32 statistics, output
    in the compute dtype). On TensorFlow outside XLA, for a float16/bfloat16 input
    normalised over its last axis, it runs `keras_mp.tf.normalization`: forward and backward
    as one XLA cluster each, keeping only the input and two float32 numbers per row for the
    backward pass (Keras' layer keeps float32 copies of the input and of its normalised
    values). Inputs of fewer than `keras_mp.tf.normalization.MIN_ELEMENTS` values, where
    launching the clusters costs more than it saves, inputs with an inner axis unknown when
    the graph is built (sequences padded per batch: XLA would compile the clusters again for
    every length), and everything else take Keras' layer.
    `keras_mp.convert` uses it for Keras' `LayerNormalization` under the `"normalization"`
    keep-list entry.

    Args:
        **kwargs: The arguments of `keras.layers.LayerNormalization` (`axis`, `epsilon`,
            `center`, `scale`, initializers, regularizers, constraints, `dtype`, ...).

    Returns:
        The normalised input, in the layer's compute dtype.

    Example:

    ```python
    keras.config.set_dtype_policy("mixed_bfloat16")
    y = kmp.layers.LayerNormalization()(x)     # bfloat16 out, float32 statistics
    ```
    """

    def _uses_tf_kernel(self, inputs) -> bool:
        if keras.backend.backend() != "tensorflow" or self.rms_scaling:
            return False
        rank = len(inputs.shape)
        if [a % rank for a in self.axis] != [rank - 1]:
            return False
        from keras_mp.tf.export import writing_a_saved_model

        if writing_a_saved_model():  # serving graphs (and TFLite) take Keras' ops
            return False
        from keras_mp.tf.normalization import MIN_ELEMENTS
        from keras_mp.tf.xla import worth_a_cluster

        return worth_a_cluster(inputs, MIN_ELEMENTS, self.compute_dtype)

    def call(self, inputs):
        if not self._uses_tf_kernel(inputs):
            return super().call(inputs)
        from keras_mp.tf.normalization import layer_norm_float32_math

        return layer_norm_float32_math(
            ops.cast(inputs, self.compute_dtype),
            None if self.gamma is None else self.gamma.value,
            None if self.beta is None else self.beta.value,
            self.epsilon,
        )
