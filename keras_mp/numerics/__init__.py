"""The float32 islands: what runs in float32 whatever the compute dtype.

- `layers`: `Float32(layer)`, `Softmax`, `MultiHeadAttention` (softmax in float32),
  `LayerNormalization` (`kmp.layers`).
- `activations`: `gelu` with its math in float32 (`kmp.activations`); `gelu_math`: that math,
  shared with `keras_mp.tf.activations`.
- `losses`: the cross-entropies, float32 math always (`kmp.losses`); `label_range`: their
  check of class labels against the predictions' range.
- `recast`: variables re-created in another dtype, float32 statistics.
- `added_losses`: `add_loss` and Keras' built-in regularizers give float32 (a patch).
- `normalization_adapt`: `Normalization.adapt` in float32 under a low compute dtype (a patch).
- `linear_cross_entropy`: a language model's head and cross-entropy fused, vocabulary
  chunk by chunk, float32 log-sum-exp, never the whole logits (issue 54);
  `fused_lm_loss`: `use_fused_loss(task)`, that loss in a causal LM's `fit` (`kmp.use_fused_loss`).

`kmp.layers`, `kmp.activations` and `kmp.losses` are these modules; `keras_mp.layers`,
`keras_mp.activations` and `keras_mp.losses` (the paths before the regroup, issue 53) name them.

Nothing is imported here: the backend parts these modules call (`keras_mp.tf.activations`,
`keras_mp.tf.normalization`) import `gelu_math` back, and importing one island needs no other.
"""

__all__ = [
    "activations",
    "added_losses",
    "fused_lm_loss",
    "gelu_math",
    "label_range",
    "layers",
    "linear_cross_entropy",
    "losses",
    "normalization_adapt",
    "recast",
]
