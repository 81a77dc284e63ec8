"""Precision policies, the FP32 keep-list, and one-call conversion of existing models.

A `Policy` is a `keras.DTypePolicy` (compute and variable dtype) plus a keep-list of
numerically sensitive layers that stay in float32. `set_global_policy` installs its base
Keras policy for layers created afterwards; `convert` rebuilds an existing model under a
policy with the keep-list applied and the weights carried over bit for bit.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable
from typing import Any

import keras
from keras.src.models.functional import Functional  # what keras.models.clone_model uses

__all__ = [
    "DEFAULT_KEEP_FP32",
    "VALID_NAMES",
    "Policy",
    "convert",
    "global_policy",
    "set_global_policy",
]

# name -> (compute dtype, variable dtype). "float8" is reserved for issue 7 (FP8 training).
_POLICIES = {
    "float32": ("float32", "float32"),
    "mixed_float16": ("float16", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
    "float16": ("float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16"),
    # FP8 matmuls in Dense/EinsumDense (keras_mp.float8); everything else as mixed_bfloat16.
    "float8": ("bfloat16", "float32"),
}
VALID_NAMES = tuple(_POLICIES)

_SOFTMAX_NAMES = ("softmax", "log_softmax")
_TOKENS = {
    "softmax": "stock Softmax layers (convert swaps them for keras_mp.layers.Softmax, FP32 "
    "inside), Activation('softmax'/'log_softmax'), any layer whose `activation` is softmax "
    "or log_softmax, and the softmax sublayer of stock attention layers",
    "attention": "convert swaps keras.layers.MultiHeadAttention for "
    "keras_mp.layers.MultiHeadAttention (softmax in FP32); pins Attention/AdditiveAttention",
    "output": "the layer(s) producing model.outputs: FP32 logits math. A linear projection "
    "emitting logits (Dense/EinsumDense/Conv with a linear activation) keeps its matmul in the "
    "compute dtype (FP32 accumulation) under mixed policies, since keras_mp.losses and Keras' "
    "losses take the log-softmax in FP32; any other output layer (softmax, sigmoid or another "
    "activation, a non-projection layer), and all of them under pure float16/bfloat16, is pinned",
    "normalization": "normalization statistics in FP32: Keras' BatchNormalization, "
    "LayerNormalization, GroupNormalization and RMSNormalization already compute them in "
    "float32 internally and stay in the compute dtype (no extra casts) under mixed policies; "
    "other normalization layers, and all of them under pure float16/bfloat16, are pinned",
}

# Keras normalization layers whose `call` up-casts to float32 for the statistics and casts
# only the result back: pinning them would add FP32 activations and casts for nothing.
_NATIVE_FP32_STATISTICS = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
    keras.layers.RMSNormalization,
)
_NORMALIZATION = _NATIVE_FP32_STATISTICS + (keras.layers.UnitNormalization,)

# Output layers that are plain projections: with a linear activation they emit logits, whose
# numerically sensitive part (the log-softmax and the loss) the losses take in FP32.
_PROJECTIONS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
)

DEFAULT_KEEP_FP32 = (
    "softmax",
    "attention",
    "output",
    "normalization",
)
"""The default FP32 keep-list.

Entries are matched against each layer (nested layers included):

- a layer class (e.g. `keras.layers.Dense`): matches instances, subclasses included;
- a token: `"softmax"`, `"attention"`, `"output"` or `"normalization"` (see `Policy`);
- any other string: a class name matched against the layer's class and its bases
  (`"BatchNormalization"` also matches `SyncBatchNormalization`), or an `fnmatch` pattern
  matched against the layer's name and path (`"*head*"`, `"encoder/*"`).

Losses are not layers: use `keras_mp.losses`, which compute in FP32 whatever the input dtype
(Keras' own losses default to float32 too). The `"output"` entry asks for FP32 math after the
last matmul: an output layer that only projects to logits (Dense, EinsumDense or Conv with a
linear activation) keeps its matmul in the compute dtype under the mixed policies (tensor
cores accumulate in FP32; the loss up-casts the logits), because running the vocabulary
projection of a language model in FP32 costs about a fifth of the whole step on a GPU (issue
8's measurement: 22% of the step, 19% more memory). Output layers that do more (a softmax or
sigmoid activation, a `Softmax`/`Activation` layer, anything else) are pinned, as are all of
them under pure float16/bfloat16. To pin the logits projection too, add its name, e.g.
`DEFAULT_KEEP_FP32 + ("head",)`.

`"normalization"` asks for FP32 statistics, which Keras' own BatchNormalization,
LayerNormalization, GroupNormalization and RMSNormalization already compute internally:
under the mixed policies they stay in the compute dtype (pinning them whole would only add
FP32 activations and casts); `convert` rebuilds Keras' LayerNormalization as
`keras_mp.layers.LayerNormalization` (the same math, with a fused TensorFlow kernel for
low-precision inputs). To run a whole normalization layer in FP32 anyway, add its class
name, e.g. `DEFAULT_KEEP_FP32 + ("LayerNormalization",)`.

Extend with `DEFAULT_KEEP_FP32 + ("*head*",)`; remove entries by value, e.g.
`tuple(e for e in DEFAULT_KEEP_FP32 if e != "output")`.
"""


def _check_entry(entry: Any) -> Any:
    if isinstance(entry, type) and issubclass(entry, keras.layers.Layer):
        return entry
    if isinstance(entry, str) and entry.strip():
        return entry
    raise ValueError(
        f"Invalid keep_fp32 entry {entry!r}. Valid entries are keras.layers.Layer subclasses, "
        f"layer class names (e.g. 'BatchNormalization'), fnmatch patterns over layer names or "
        f"paths (e.g. '*head*'), or the tokens {sorted(_TOKENS)}."
    )


def _has_softmax_activation(layer: keras.layers.Layer) -> bool:
    activation = getattr(layer, "activation", None)
    return callable(activation) and getattr(activation, "__name__", "") in _SOFTMAX_NAMES


def _emits_logits(layer: keras.layers.Layer) -> bool:
    """A projection layer with a linear activation (its output is logits, nothing more)."""
    if not isinstance(layer, _PROJECTIONS):
        return False
    activation = getattr(layer, "activation", None)
    return activation is None or getattr(activation, "__name__", "") == "linear"


def _entry_matches(entry: Any, layer: keras.layers.Layer, outputs: frozenset) -> bool:
    if isinstance(entry, type):
        return isinstance(layer, entry)
    if entry == "softmax":  # keras_mp's own softmax layers already compute in FP32
        if type(layer).__module__.startswith("keras_mp."):
            return False
        return isinstance(layer, keras.layers.Softmax) or _has_softmax_activation(layer)
    if entry == "attention":
        return isinstance(layer, (keras.layers.Attention, keras.layers.AdditiveAttention))
    if entry == "output":
        return id(layer) in outputs
    if entry == "normalization":
        return isinstance(layer, _NORMALIZATION)
    mro = type(layer).__mro__
    if any(entry in (c.__name__, keras.saving.get_registered_name(c)) for c in mro):
        return True
    return fnmatch.fnmatchcase(layer.name, entry) or (
        layer.path is not None and fnmatch.fnmatchcase(layer.path, entry)
    )


@keras.saving.register_keras_serializable(package="keras_mp")
class Policy(keras.DTypePolicy):
    """A precision policy: compute/variable dtypes plus an FP32 keep-list.

    Names: `"float32"`; `"mixed_float16"` and `"mixed_bfloat16"` (low-precision compute,
    FP32 master weights); the pure `"float16"` and `"bfloat16"` (variables in low precision,
    no master weights: kept for comparison, a warning says so); `"float8"` (FP8 matmuls in
    Dense/EinsumDense with delayed scaling, see `keras_mp.float8`; everything else as under
    `"mixed_bfloat16"`; the FP8 layers are made by `convert`).

    Under a low-precision policy the layers matched by `keep_fp32` get the `"float32"` Keras
    policy; all others get `policy.base`. Keep-list tokens: `"softmax"` (softmax/log-softmax
    layers and activations), `"attention"` (stock multi-head attention is swapped for
    `keras_mp.layers.MultiHeadAttention` by `convert`; `Attention`/`AdditiveAttention` pinned),
    `"output"` (FP32 after the last matmul of the layers producing `model.outputs`). See
    `DEFAULT_KEEP_FP32` for the details and the rest.

    `Policy` is itself a `keras.DTypePolicy` (its compute and variable dtypes are those of
    its name), so it can be passed wherever Keras takes a dtype policy.

    Args:
        name: One of `"float32"`, `"mixed_float16"`, `"mixed_bfloat16"`, `"float16"`,
            `"bfloat16"`, `"float8"`.
        keep_fp32: Iterable of keep-list entries (layer classes, class names, fnmatch
            name/path patterns, tokens). Defaults to `DEFAULT_KEEP_FP32`.
        float8_recipe: for `"float8"` only: a `keras_mp.float8.Float8Recipe` (or its
            config dict); default `Float8Recipe()`.

    Example:

    ```python
    policy = kmp.Policy("mixed_bfloat16", keep_fp32=kmp.DEFAULT_KEEP_FP32 + ("*head*",))
    policy.for_layer(keras.layers.LayerNormalization()).name   # 'float32'
    policy.for_layer(keras.layers.Dense(4)).name                # 'mixed_bfloat16'
    ```
    """

    def __init__(
        self, name: str, keep_fp32: Iterable = DEFAULT_KEEP_FP32, float8_recipe: Any = None
    ):
        if isinstance(keep_fp32, (str, type)) or not isinstance(keep_fp32, Iterable):
            raise ValueError(
                "keep_fp32 must be a list/tuple of entries (classes, class names, patterns or "
                f"tokens {sorted(_TOKENS)}), e.g. DEFAULT_KEEP_FP32 + ('*head*',). "
                f"Received: keep_fp32={keep_fp32!r}"
            )
        self._keep_fp32 = tuple(_check_entry(e) for e in keep_fp32)
        super().__init__(name)
        self.float8_recipe = None
        if name == "float8":
            from keras_mp.float8 import _recipe

            self.float8_recipe = _recipe(float8_recipe)
        elif float8_recipe is not None:
            raise ValueError(
                f"`float8_recipe` applies only to the 'float8' policy, not {name!r}."
            )
        self._warn_if_pure()

    def _parse_name(self, name):
        if name not in _POLICIES:
            raise ValueError(f"Unknown policy name {name!r}. Valid names: {list(VALID_NAMES)}.")
        return _POLICIES[name]

    def _warn_if_pure(self) -> None:
        if self.is_low_precision and not self.has_master_weights:
            warnings.warn(
                f"Policy {self.name!r} keeps variables in {self.variable_dtype} with no FP32 "
                f"master weights: small updates are rounded away. Use "
                f"'mixed_{self.name}' for training; {self.name!r} is for comparison.",
                UserWarning,
                stacklevel=3,
            )

    @property
    def keep_fp32(self) -> tuple:
        """The keep-list entries, as a tuple."""
        return self._keep_fp32

    @property
    def has_master_weights(self) -> bool:
        """True when variables are float32 (the mixed and float32 policies)."""
        return self.variable_dtype == "float32"

    @property
    def is_low_precision(self) -> bool:
        """True when the compute dtype is not float32."""
        return self.compute_dtype != "float32"

    @property
    def base(self) -> keras.DTypePolicy:
        """The plain Keras policy given to layers that are not on the keep-list."""
        return keras.DTypePolicy("mixed_bfloat16" if self.name == "float8" else self.name)

    def keep_entry(self, layer: keras.layers.Layer, output_layers: Iterable = ()) -> Any:
        """The first keep-list entry matching `layer`, or `None`.

        Args:
            layer: A Keras layer.
            output_layers: Layers producing the model outputs (for the `"output"` token).

        Returns:
            The matching entry (class or string), or `None` if the layer is not pinned.
        """
        outputs = frozenset(id(x) for x in output_layers)
        for entry in self._keep_fp32:
            if _entry_matches(entry, layer, outputs):
                return entry
        return None

    def for_layer(
        self, layer: keras.layers.Layer, output_layers: Iterable = ()
    ) -> keras.DTypePolicy:
        """The Keras policy `layer` should run under.

        Args:
            layer: A Keras layer.
            output_layers: Layers producing the model outputs (for the `"output"` token).

        Returns:
            `keras.DTypePolicy("float32")` for keep-list layers under a low-precision policy
            (except, with FP32 master weights, where the listed math is FP32 without pinning:
            Keras' own normalization layers under `"normalization"`, logits projections
            under `"output"`), else `self.base`.
        """
        if not self.is_low_precision:
            return self.base
        outputs = frozenset(id(x) for x in output_layers)
        for entry in self._keep_fp32:
            if not _entry_matches(entry, layer, outputs):
                continue
            native = (entry == "normalization" and type(layer) in _NATIVE_FP32_STATISTICS) or (
                entry == "output" and _emits_logits(layer)
            )
            if not (native and self.has_master_weights):
                return keras.DTypePolicy("float32")
        return self.base

    def dtype_policy_map(self, model: keras.Model) -> keras.dtype_policies.DTypePolicyMap:
        """A `DTypePolicyMap` over the layer paths of a built `model`.

        Keys are the paths of the keep-list layers (value: float32); every other path
        resolves to the map's default, `self.base`.

        Args:
            model: A built Keras model.

        Returns:
            A `keras.dtype_policies.DTypePolicyMap`.
        """
        outputs = _output_layers(model)
        policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=self.base)
        for layer in model._flatten_layers(include_self=False):
            target = self.for_layer(layer, outputs)
            if layer.path and target.name != self.base.name and layer.path not in policy_map:
                policy_map[layer.path] = target
        return policy_map

    def get_config(self) -> dict:
        keep = [e.__name__ if isinstance(e, type) else e for e in self._keep_fp32]
        config = {"name": self.name, "keep_fp32": keep}
        if self.float8_recipe is not None:
            config["float8_recipe"] = self.float8_recipe.get_config()
        return config

    @classmethod
    def from_config(cls, config: dict) -> Policy:
        return cls(**config)

    def __eq__(self, other):
        return (
            type(other) is type(self)
            and other.name == self.name
            and other.keep_fp32 == self.keep_fp32
            and other.float8_recipe == self.float8_recipe
        )

    __hash__ = None

    def __repr__(self):
        return f'<Policy "{self.name}" keep_fp32={list(self.get_config()["keep_fp32"])}>'


def _as_policy(policy: Any) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, keras.DTypePolicy) and policy.quantization_mode is None:
        policy = policy.name
    if isinstance(policy, str):
        return Policy(policy)
    raise ValueError(
        f"Expected a keras_mp.Policy or a policy name, one of {list(VALID_NAMES)}. "
        f"Received: {policy!r}"
    )


_global: dict = {"policy": None}


def set_global_policy(policy: str | Policy) -> None:
    """Sets the global precision policy.

    Keras' global dtype policy (`keras.config.set_dtype_policy`) becomes `policy.base`, so
    layers created afterwards compute in the low dtype. The keep-list is not applied to
    layers as they are created: call `convert(model, kmp.global_policy())` on the built model,
    or build sensitive parts from `keras_mp.layers` / with `dtype="float32"`. The
    `keras_mp.Policy` is remembered and returned by `global_policy()`.

    Args:
        policy: A `Policy` or a policy name.

    Example:

    ```python
    kmp.set_global_policy("mixed_bfloat16")
    keras.layers.Dense(4).compute_dtype   # 'bfloat16'
    ```
    """
    policy = _as_policy(policy)
    keras.config.set_dtype_policy(policy.base)
    _global["policy"] = policy


def global_policy() -> Policy:
    """The global `Policy`.

    Returns the policy given to `set_global_policy` while Keras' global dtype policy still
    has its name; if Keras' global policy was changed directly, a `Policy` of that name with
    the default keep-list.

    Returns:
        A `Policy`.

    Raises:
        ValueError: if Keras' global policy has a name keras_mp does not know (e.g. float64).
    """
    current = keras.config.dtype_policy()
    if isinstance(current, Policy):  # set directly with keras.config.set_dtype_policy
        return current
    current, remembered = current.name, _global["policy"]
    if remembered is not None and remembered.base.name == current:
        return remembered
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Policy(current)


def _output_layers(model: keras.Model) -> list:
    """The layers producing `model.outputs`: the logits layer(s).

    Descends into nested models, and walks back through a final stateless `Softmax` /
    `Activation` to the layer whose output it normalises.
    """
    if isinstance(model, Functional):
        found = [t._keras_history[0] for t in keras.tree.flatten(model.outputs)]
    else:  # Sequential, or subclassed (no graph): the last top-level layer is the head
        found = model.layers[-1:]
    result = []
    while found:
        layer = found.pop()
        result.append(layer)
        if isinstance(layer, keras.Model):
            result.extend(_output_layers(layer))
        elif isinstance(layer, (keras.layers.Softmax, keras.layers.Activation)):
            if isinstance(model, Functional) and layer._inbound_nodes:
                node = layer._inbound_nodes[0]
                found += [t._keras_history[0] for t in node.input_tensors]
            elif layer in model.layers[1:]:
                found.append(model.layers[model.layers.index(layer) - 1])
    return result


def convert(model: keras.Model, policy: str | Policy) -> keras.Model:
    """Returns a copy of `model` running under `policy`, with its weights.

    Every layer (nested ones included) gets `policy.for_layer(layer)`: float32 for the
    keep-list, `policy.base` otherwise (a `dtype=` set on a source layer is replaced: add the
    layer to the keep-list to keep it in FP32). Under the `"attention"` / `"softmax"` entries stock
    `keras.layers.MultiHeadAttention` / `keras.layers.Softmax` become their `keras_mp.layers`
    versions (same config and weights), as does `keras.layers.LayerNormalization` under
    `"normalization"`; layers whose activation is Keras' GELU get `keras_mp.activations.gelu`.
    The last two are the same math with fused TensorFlow kernels for low-precision tensors
    (XLA clusters inside the ordinary TF graph: the GELU was the costliest element-wise work
    of the bfloat16 `cpu_gpt` step on TF). Weights are copied exactly (FP32 master weights are
    bit-identical; pure float16/bfloat16 policies round them). The original model is not
    modified. Under `"float8"` the output layers keep their bfloat16 matmul (no FP8 for the
    logits projection). If it was compiled, the copy is compiled from the same compile config;
    compile it again to use `keras_mp.LossScaleOptimizer` / `keras_mp.losses`.

    Supported: Functional and Sequential models (nested ones included), via
    `keras.models.clone_model`, and subclassed models whose class round-trips through
    `get_config()`/`from_config()` (Keras' automatic config of simple constructor arguments
    counts); for those the `"output"` entry means the last layer in `model.layers`, and their
    attention layers keep the stock class with the inner softmax pinned to float32. Every layer
    must round-trip through `get_config()`/`from_config()`; the model must be built.

    Args:
        model: A built Keras model.
        policy: A `Policy` or a policy name.

    Returns:
        A new, built `keras.Model`.

    Raises:
        ValueError: for an unknown policy name, an unbuilt model, or a layer / subclassed
            model that cannot be rebuilt from its config (the message names it).

    Example:

    ```python
    model = keras.applications.MobileNetV2(weights=None, input_shape=(64, 64, 3))
    mixed = kmp.convert(model, "mixed_bfloat16")
    mixed.get_layer("predictions").compute_dtype   # 'float32' (the output layer)
    ```
    """
    from keras_mp._convert import convert_model

    policy = _as_policy(policy)
    new = convert_model(model, policy)  # float8 converts as mixed_bfloat16 + keep-list
    if policy.name == "float8":
        from keras_mp.float8 import apply_float8  # lazy: float8 imports this module

        apply_float8(new, policy.float8_recipe)  # the output layers stay bfloat16
    return new
