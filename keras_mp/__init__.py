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

# First: it hides TensorFlow's C++ INFO lines if it is keras_mp that imports TensorFlow.
import keras_mp.patches as patches
from keras_mp import (
    activations,
    conversion,
    fingerprint,
    float8,
    formats,
    hardware,
    keep_list,
    layers,
    lean,
    losses,
    observe,
    saving,
)
from keras_mp.conversion import convert, plan
from keras_mp.fit import FitReport, will_it_fit  # deprecated aliases
from keras_mp.lean import LeanOptimizer, state_bytes
from keras_mp.loss_scale import LossScaleOptimizer
from keras_mp.memory_estimate import MemoryReport, estimate_memory
from keras_mp.observe import AuditReport, LossScaleCollapseError, audit, callbacks
from keras_mp.policies import (
    DEFAULT_KEEP_FP32,
    Policy,
    global_policy,
    set_global_policy,
)
from keras_mp.recompute import recompute_elementwise
from keras_mp.tf.export import export_saved_model  # imports tensorflow only when called
from keras_mp.version import __version__

_sys.modules[__name__ + ".callbacks"] = callbacks  # `import keras_mp.callbacks` as before

# What this changes in Keras for every model, and how to opt out: keras_mp/patches.py, README.
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
    "recompute_elementwise",
    "activations",
    "formats",
    "layers",
    "losses",
    "DEFAULT_KEEP_FP32",
    "Policy",
    "convert",
    "plan",
    "keep_list",
    "global_policy",
    "set_global_policy",
    "export_saved_model",
    "saving",
    "callbacks",
    "conversion",
    "observe",
    "patches",
    "fingerprint",
    "hardware",
    "float8",
    "audit",
    "AuditReport",
    "LossScaleCollapseError",
    "__version__",
]
