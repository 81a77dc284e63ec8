"""The lean training state: bfloat16 weights with compensated updates and compact moments.

The face of the subpackage: `LeanOptimizer` (`optimizer.py`; the variables it builds,
`state.py`, and the step it applies, `step.py`), its pure update rule
(`rule.py`) and its packed form for many variables at once (`packing.py`; the optimizer's
packed groups and whole-step update, `packed_step.py`), the storage
formats (`codecs.py`; the factored second moment, `factored.py`), the general path for
any other Keras optimizer (`general.py`), the state's layout across devices (`sharding.py`) and
`state_bytes` (`memory.py`); `ema_update` (`ema.py`), moving averages of lean weights
that move; the update inside the backward pass (JAX, `in_backward.py`, its custom-VJP tags
in `backward_tags.py`), imported where a model is compiled with it.
"""

from keras_mp.lean import codecs, factored, general, packing, rule, sharding
from keras_mp.lean.ema import ema_update
from keras_mp.lean.memory import StateBytes, state_bytes, variable_bytes
from keras_mp.lean.optimizer import (
    DEFAULT_MOMENTS,
    DEFAULT_ROUNDING,
    SUPPORTED,
    LeanOptimizer,
)
from keras_mp.lean.rule import lean_rule

__all__ = [
    "DEFAULT_MOMENTS",
    "DEFAULT_ROUNDING",
    "LeanOptimizer",
    "SUPPORTED",
    "StateBytes",
    "codecs",
    "ema_update",
    "factored",
    "general",
    "lean_rule",
    "packing",
    "rule",
    "sharding",
    "state_bytes",
    "variable_bytes",
]
