"""keras_mp: mixed-precision training for Keras 3.

FP32 master weights with FP16/BF16 compute, safe dynamic loss scaling, a short list
of numerically sensitive ops pinned to FP32, and tools to see what goes wrong.

Example:

```python
import keras, keras_mp as kmp

model = kmp.convert(model, "mixed_float16")
opt = kmp.LossScaleOptimizer(keras.optimizers.AdamW(1e-3))
model.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
```
"""

import sys as _sys

from keras_mp.keras_glue.extras import missing_backend as _missing_backend

if "keras" not in _sys.modules and (_why := _missing_backend()):  # Keras' import would fail
    raise ImportError(f"keras_mp cannot start Keras: {_why}")

# First: it hides TensorFlow's C++ INFO lines if it is keras_mp that imports TensorFlow.
import keras_mp.keras_glue.patches as patches
from keras_mp import (
    conversion,
    fingerprint,
    float8,
    formats,
    hardware,
    keep_list,
    lean,
    memory,
    numerics,
    observe,
    saving,
    scaling,
)
from keras_mp.conversion import convert, plan
from keras_mp.lean import LeanOptimizer, state_bytes
from keras_mp.memory import (  # deprecated aliases
    FitReport,
    MemoryReport,
    estimate_memory,
    recompute_blocks,
    recompute_elementwise,
    will_it_fit,
)
from keras_mp.numerics import activations, layers, losses
from keras_mp.numerics.fused_lm_loss import use_fused_loss
from keras_mp.observe import AuditReport, LossScaleCollapseError, audit, callbacks
from keras_mp.policies import (
    DEFAULT_KEEP_FP32,
    Policy,
    global_policy,
    set_global_policy,
)
from keras_mp.scaling import LossScaleOptimizer
from keras_mp.tf.export import export_saved_model  # imports tensorflow only when called
from keras_mp.version import __version__

# The module paths before the regroup (issue 53), which users' code and the `module` field
# of saved configs name, stay importable as aliases of the same modules (not copies):
# `import keras_mp.loss_scale` gives `keras_mp.scaling.loss_scale` itself.
_MOVED = {
    "callbacks": "observe.callbacks",
    "loss_scale": "scaling.loss_scale",
    "loss_scale_rule": "scaling.loss_scale_rule",
    "loss_scale_marks": "scaling.loss_scale_marks",
    "grad_finite": "scaling.grad_finite",
    "autoscale": "scaling.autoscale",
    "optimizer_guard": "scaling.optimizer_guard",
    "layers": "numerics.layers",
    "activations": "numerics.activations",
    "gelu_math": "numerics.gelu_math",
    "losses": "numerics.losses",
    "recast": "numerics.recast",
    "float8_payoff": "float8.payoff",
    "memory_estimate": "memory.memory_estimate",
    "fit": "memory.fit",
    "recompute": "memory.recompute",
    "atomic": "saving.atomic",
    "sublayer_dtypes": "saving.sublayer_dtypes",
    "patches": "keras_glue.patches",
    "keras_internals": "keras_glue.keras_internals",
    "backend_logs": "keras_glue.backend_logs",
    "quiet": "keras_glue.quiet",
    "extras": "keras_glue.extras",
}


def _alias_moved_modules() -> None:
    import importlib

    for old, new in _MOVED.items():
        module = importlib.import_module(f"{__name__}.{new}")
        _sys.modules[f"{__name__}.{old}"] = module
        globals().setdefault(old, module)  # `keras_mp.loss_scale.X` after `import keras_mp`


_alias_moved_modules()

# What this changes in Keras for every model, and how to opt out: keras_mp/keras_glue/patches.py,
# README.
if not patches.disabled():  # KERAS_MP_NO_PATCH=1: nothing is changed
    patches.install()  # compile() gets keras_mp's optimizers; optimizers' apply checks once

__all__ = [
    "MemoryReport",
    "estimate_memory",
    "FitReport",
    "will_it_fit",
    "LeanOptimizer",
    "LossScaleOptimizer",
    "lean",
    "state_bytes",
    "recompute_blocks",
    "recompute_elementwise",
    "activations",
    "formats",
    "layers",
    "losses",
    "DEFAULT_KEEP_FP32",
    "Policy",
    "convert",
    "plan",
    "use_fused_loss",
    "keep_list",
    "global_policy",
    "set_global_policy",
    "export_saved_model",
    "saving",
    "callbacks",
    "conversion",
    "memory",
    "numerics",
    "observe",
    "scaling",
    "patches",
    "fingerprint",
    "hardware",
    "float8",
    "audit",
    "AuditReport",
    "LossScaleCollapseError",
    "__version__",
]
