"""The keep-list: which layers a policy keeps in float32, and why (`kmp.keep_list`).

The face of the subpackage. A `Policy` is built on it: the entries and what a single layer
matches, and `plan()`, the rules that lift a pin to a block or a subtree (`rules.py`); the
decisions they produce, `Pin` and `Plan` (`decision.py`); and the model's layer tree they
walk (`tree.py`). It sits below `keras_mp.policies` and `keras_mp.conversion`, which use it.
"""

from keras_mp.keep_list.rules import (
    ALONE,
    DEFAULT_KEEP_FP32,
    TOKENS,
    Pin,
    Plan,
    addresses,
    check_entry,
    emits_logits,
    entry_matches,
    graph_nodes,
    has_native_fp32_statistics,
    is_router,
    layer_rule,
    layer_tree,
    output_layers,
    plan,
    serializes_its_layers,
    squashes,
    sublayers,
)

__all__ = [
    "ALONE",
    "DEFAULT_KEEP_FP32",
    "TOKENS",
    "Pin",
    "Plan",
    "check_entry",
    "emits_logits",
    "entry_matches",
    "graph_nodes",
    "addresses",
    "has_native_fp32_statistics",
    "is_router",
    "layer_rule",
    "layer_tree",
    "output_layers",
    "plan",
    "serializes_its_layers",
    "squashes",
    "sublayers",
]
