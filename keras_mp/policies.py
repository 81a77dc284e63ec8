"""Precision policies: what a policy is.

A `Policy` is a `keras.DTypePolicy` (compute and variable dtype) plus a keep-list of
numerically sensitive layers that stay in float32 (`keras_mp.keep_list` says what its
entries mean). `set_global_policy` installs its base Keras policy for layers created
afterwards. Turning an existing model into a policy's model is `keras_mp.convert`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from typing import Any

import keras

import keras_mp.keep_list as keep_list
from keras_mp.keras_glue.quiet import ignoring

__all__ = [
    "DEFAULT_KEEP_FP32",
    "VALID_NAMES",
    "Policy",
    "as_policy",
    "global_policy",
    "remembered_policy",
    "set_global_policy",
]

# name -> (compute dtype, variable dtype).
_POLICIES = {
    "float32": ("float32", "float32"),
    "mixed_float16": ("float16", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
    "float16": ("float16", "float16"),
    "bfloat16": ("bfloat16", "bfloat16"),
    # FP8 matmuls in Dense/EinsumDense (keras_mp.float8); everything else as mixed_bfloat16.
    "float8": ("bfloat16", "float32"),
    # bfloat16 weights with compensated updates and compact moments (keras_mp.lean).
    "lean_bfloat16": ("bfloat16", "bfloat16"),
}
VALID_NAMES = tuple(_POLICIES)

DEFAULT_KEEP_FP32 = keep_list.DEFAULT_KEEP_FP32
"""The default FP32 keep-list: `("softmax", "attention", "output", "normalization", "router")`.

Entries are matched against every layer of a model, nested ones included:

- a layer class (e.g. `keras.layers.Dense`): matches instances, subclasses included;
- a token: `"softmax"`, `"attention"`, `"output"` or `"normalization"` (see below);
- any other string: a class name matched against the layer's class and its bases
  (`"BatchNormalization"` also matches `SyncBatchNormalization`), or an `fnmatch` pattern
  matched against the layer's name and path (`"*head*"`, `"encoder/*"`).

The tokens:

- `"softmax"`: softmax and log-softmax run in float32. A stock `Softmax` in a Functional or
  Sequential graph becomes `keras_mp.layers.Softmax` (float32 inside, output in the compute
  dtype); other softmax layers and layers whose activation is softmax are pinned.
- `"attention"`: a stock `MultiHeadAttention` in a graph becomes
  `keras_mp.layers.MultiHeadAttention`; inside a block (keras_hub's transformer layers) its
  softmax sublayer is pinned instead; `Attention`/`AdditiveAttention` are pinned.
- `"output"`: the leaf layer(s) producing the model's outputs are pinned when they squash
  (a softmax, sigmoid or tanh head; under pure policies, any with weights). A linear logits
  projection keeps its low-precision matmul under the mixed policies (tensor cores
  accumulate in float32 and the loss takes the log-softmax in float32; running the
  vocabulary projection in float32 costs about a fifth of a language model's step on a
  GPU). A transformer block, a nested model, a final add or relu is not a head.
- `"router"`: the router of a mixture-of-experts block runs in float32 (its logits pick the
  experts and feed the load-balancing loss); the experts stay in the compute dtype.
- `"normalization"`: statistics in float32. Keras' BatchNormalization, LayerNormalization,
  GroupNormalization and RMSNormalization compute them in float32 internally and are not
  pinned; other Keras normalization layers are. To pin one whole anyway, add its class
  name, e.g. `DEFAULT_KEEP_FP32 + ("LayerNormalization",)`.

A pin covers the layer's sublayers, and a pin inside a block whose `call` combines its
sublayers' outputs is lifted to the block (see `keras_mp.keep_list`). Losses are not layers:
use `keras_mp.losses` (FP32 math whatever the input dtype).

Extend with `DEFAULT_KEEP_FP32 + ("*head*",)`; remove entries by value, e.g.
`tuple(e for e in DEFAULT_KEEP_FP32 if e != "output")`.
"""


@keras.saving.register_keras_serializable(package="keras_mp")
class Policy(keras.DTypePolicy):
    """A precision policy: compute/variable dtypes plus an FP32 keep-list.

    Names: `"float32"`; `"mixed_float16"` and `"mixed_bfloat16"` (low-precision compute,
    FP32 master weights); the pure `"float16"` and `"bfloat16"` (variables in low precision,
    no master weights: kept for comparison, a warning says so); `"float8"` (FP8 matmuls in
    Dense/EinsumDense with delayed scaling, see `keras_mp.float8`; everything else as under
    `"mixed_bfloat16"`; the FP8 layers are made by `convert`); `"lean_bfloat16"`
    (bfloat16 compute as `"mixed_bfloat16"`, but trainable weights stored in bfloat16 and
    updated by `keras_mp.LeanOptimizer` with float32 arithmetic, stochastic rounding and
    4-bit moments: about 3 bytes of training state a parameter instead of 12 or more; the
    keep-list's layers keep float32 weights).

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
            `"bfloat16"`, `"float8"`, `"lean_bfloat16"`.
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
                f"tokens {sorted(keep_list.TOKENS)}), e.g. DEFAULT_KEEP_FP32 + ('*head*',). "
                f"Received: keep_fp32={keep_fp32!r}"
            )
        self._keep_fp32 = tuple(keep_list.check_entry(e) for e in keep_fp32)
        super().__init__(name)
        self.float8_recipe = None
        if name == "float8":
            from keras_mp.float8.recipe import as_recipe

            self.float8_recipe = as_recipe(float8_recipe)
        elif float8_recipe is not None:
            raise ValueError(f"`float8_recipe` applies only to the 'float8' policy, not {name!r}.")
        self._warn_if_pure()

    def _parse_name(self, name):
        if name not in _POLICIES:
            raise ValueError(f"Unknown policy name {name!r}. Valid names: {list(VALID_NAMES)}.")
        return _POLICIES[name]

    def _warn_if_pure(self) -> None:
        if self.is_low_precision and not self.has_master_weights and not self.is_lean:
            warnings.warn(
                f"Policy {self.name!r} keeps variables in {self.variable_dtype} with no FP32 "
                f"master weights: small updates are rounded away. Use "
                f"'mixed_{self.name}' for training"
                + (
                    " ('lean_bfloat16' for bfloat16 weights whose updates are kept)"
                    if self.name == "bfloat16"
                    else ""
                )
                + f"; {self.name!r} is for comparison.",
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
    def is_lean(self) -> bool:
        """True for `"lean_bfloat16"`: bfloat16 weights kept exact by `LeanOptimizer`."""
        return self.name == "lean_bfloat16"

    @property
    def is_low_precision(self) -> bool:
        """True when the compute dtype is not float32."""
        return self.compute_dtype != "float32"

    @property
    def base(self) -> keras.DTypePolicy:
        """The plain Keras policy given to layers that are not on the keep-list."""
        name = {"float8": "mixed_bfloat16", "lean_bfloat16": "bfloat16"}.get(self.name, self.name)
        return keras.DTypePolicy(name)

    def keep_entry(self, layer: keras.layers.Layer, output_layers: Iterable = ()) -> Any:
        """The first keep-list entry matching `layer` on its own, or `None`.

        Args:
            layer: A Keras layer.
            output_layers: Layers producing the model outputs (for the `"output"` token).

        Returns:
            The matching entry (class or string), or `None`.
        """
        outputs = frozenset(id(x) for x in output_layers)
        for entry in self._keep_fp32:
            if keep_list.entry_matches(entry, layer, outputs):
                return entry
        return None

    def for_layer(
        self, layer: keras.layers.Layer, output_layers: Iterable = ()
    ) -> keras.DTypePolicy:
        """The Keras policy the keep-list gives `layer`, taken on its own.

        Inside a model, `keras_mp.keep_list.plan` also applies the subtree and block rules
        (a pinned block pins its sublayers; a pin inside a block is lifted to the block).

        Args:
            layer: A Keras layer.
            output_layers: Layers producing the model outputs (for the `"output"` token).

        Returns:
            `keras.DTypePolicy("float32")` for a pinned layer under a low-precision policy,
            else `self.base`. Not pinned: Keras' normalization layers with float32
            statistics, and output layers that do not squash (linear logits projections
            under the mixed policies included).
        """
        if not self.is_low_precision:
            return self.base
        outputs = frozenset(id(x) for x in output_layers)
        entry, _ = keep_list.layer_rule(self, layer, outputs, graph_node=False)
        return keras.DTypePolicy("float32") if entry is not None else self.base

    def dtype_policy_map(self, model: keras.Model) -> keras.dtype_policies.DTypePolicyMap:
        """The `DTypePolicyMap` that runs a built `model` under this policy.

        Keys are the paths of the pinned layers (value: float32; a pinned block also has the
        key `"path/.*"` for its sublayers); every other path resolves to the map's default,
        `self.base`. `keras_mp.convert` gives every layer of the converted model this map,
        so the pins are saved with the model and rebuilt by Keras and keras_hub on load.

        Args:
            model: A built Keras model.

        Returns:
            A `keras.dtype_policies.DTypePolicyMap`.
        """
        return policy_map(self, keep_list.plan(model, self), model)

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


def as_policy(policy: Any) -> Policy:
    """`policy` as a `Policy`: a `Policy` as it is, a policy name or a plain
    `keras.DTypePolicy` as the `Policy` of that name (default keep-list)."""
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
    policy = as_policy(policy)
    keras.config.set_dtype_policy(policy.base)
    _global["policy"] = policy


def remembered_policy() -> Policy | None:
    """The `Policy` given to `set_global_policy` while Keras' global policy still has its
    name, else None (no keras_mp policy in effect)."""
    remembered = _global["policy"]
    if remembered is not None and keras.config.dtype_policy().name == remembered.base.name:
        return remembered
    return None


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
    with ignoring(UserWarning):
        return Policy(current)


def _key(layer, parents: dict) -> str:
    """A map key matching `layer`'s path, with the names of the models above it optional:
    Keras puts a Sequential or subclassed model's name in its layers' paths when the model
    builds them, and not when it is rebuilt from a saved config."""
    models, parent = set(), parents.get(id(layer))
    while parent is not None:
        if isinstance(parent, keras.Model):
            models.add(parent.name)
        parent = parents.get(id(parent))
    parts = layer.path.split("/")
    head = [f"(?:{re.escape(p)}/)?" if p in models else re.escape(p) + "/" for p in parts[:-1]]
    return "".join(head) + re.escape(parts[-1])


def policy_map(policy: Policy, plan: keep_list.Plan, model: keras.Model):
    """The `DTypePolicyMap` applying `plan` (from `keep_list.plan(model, policy)`).

    Its default is a `Policy` of the base dtypes with the keep-list. Keys are regular
    expressions (Keras matches a layer's path exactly first, then as `re.fullmatch`
    patterns): each pinned layer's path, escaped, with the names of enclosing models
    optional, plus `"path/.*"` for a pinned block's sublayers. `keras_mp.convert` gives the
    map to the layers it cannot give a policy of their own (see `convert.apply_plan`).
    """
    float32 = keras.DTypePolicy("float32")
    with ignoring(UserWarning):  # a pure policy warned when it was made
        name = policy.name if policy.is_lean else policy.base.name
        default = Policy(name, keep_fp32=policy.keep_fp32)
    result = keras.dtype_policies.DTypePolicyMap(default_policy=default)
    layers, parents = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    by_address = {where[id(x)]: x for x in layers}
    for pin in plan.pins:
        layer = by_address.get(pin.path)
        if layer is None or not layer.path:
            continue
        key = _key(layer, parents)
        if key not in result:
            result[key] = float32
        if keep_list.sublayers(layer) and key + "/.*" not in result:
            result[key + "/.*"] = float32
    return result
