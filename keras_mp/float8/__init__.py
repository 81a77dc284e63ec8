"""Float8 training: the recipe and its dtype policy, the float8 layers, the payoff estimate.

`kmp.float8` (this face) is what `keras_mp.float8` was before the regroup (issue 53):
`Float8Recipe`, `apply_float8`, `float8_state`, `float8_speedup_expected`, ...

- `recipe`: `Float8Recipe` (delayed scaling), `compute_scale`, `Float8DTypePolicy`.
- `layers`: `Float8Dense`, `Float8EinsumDense`, the float8 attention layers, `apply_float8`.
- `payoff`: whether FP8 pays on this machine and model (`float8_speedup_expected`).
"""

from keras_mp.float8.layers import (
    Float8Dense,
    Float8EinsumDense,
    Float8MultiHeadAttention,
    Float8SoftmaxMultiHeadAttention,
    apply_float8,
    float8_state,
)
from keras_mp.float8.payoff import (
    Float8SlowerWarning,
    float8_layers,
    float8_speedup_expected,
    float8_speedup_reason,
)
from keras_mp.float8.recipe import Float8DTypePolicy, Float8Recipe, as_recipe, compute_scale

__all__ = [
    "Float8DTypePolicy",
    "Float8SlowerWarning",
    "Float8Dense",
    "Float8EinsumDense",
    "Float8MultiHeadAttention",
    "Float8Recipe",
    "Float8SoftmaxMultiHeadAttention",
    "apply_float8",
    "as_recipe",
    "compute_scale",
    "float8_layers",
    "float8_speedup_expected",
    "float8_speedup_reason",
    "float8_state",
]
