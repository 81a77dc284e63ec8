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

import keras as _keras

# `audit` is the function: it is bound after the module of the same name is imported.
from keras_mp import (
    activations,
    autoscale,
    callbacks,
    fingerprint,
    float8,
    formats,
    hardware,
    keep_list,
    layers,
    lean,
    losses,
    optimizer_guard,
    saving,
)
from keras_mp.audit import AuditReport, audit
from keras_mp.callbacks import LossScaleCollapseError
from keras_mp.convert import convert, plan
from keras_mp.lean import LeanOptimizer
from keras_mp.loss_scale import LossScaleOptimizer
from keras_mp.memory import state_bytes
from keras_mp.policies import (
    DEFAULT_KEEP_FP32,
    Policy,
    global_policy,
    set_global_policy,
)
from keras_mp.tf.export import export_saved_model  # imports tensorflow only when called

__version__ = "0.1.0"

autoscale.install()  # compile() under a keras_mp policy gets kmp.LossScaleOptimizer
optimizer_guard.install()  # a plain optimizer on lean or float16 weights warns once
if _keras.backend.backend() == "tensorflow":  # bfloat16/uint8 variables under multi-worker
    from keras_mp.tf.distribute import widen_collective_broadcasts

    widen_collective_broadcasts()

__all__ = [
    "LeanOptimizer",
    "LossScaleOptimizer",
    "lean",
    "state_bytes",
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
    "fingerprint",
    "hardware",
    "float8",
    "audit",
    "AuditReport",
    "LossScaleCollapseError",
    "__version__",
]
