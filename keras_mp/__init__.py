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

from keras_mp.loss_scale import LossScaleOptimizer

__version__ = "0.1.0"

__all__ = [
    "LossScaleOptimizer",
    "__version__",
]
