"""Memory: the step's peak before a run, and recomputation that lowers it.

- `memory_estimate`: `estimate_memory(model, x)` and its `MemoryReport` (compile-only; JAX).
- `fit`: `will_it_fit` / `FitReport`, the deprecated names of the above.
- `recompute`: `recompute_elementwise(model)` (JAX): element-wise work recomputed in the
  backward pass, matmul outputs kept.
- `blocks`: `recompute_blocks(model)` (JAX, TensorFlow): each repeated block (a keras_hub
  backbone's decoder blocks) recomputed whole in the backward pass from its inputs.

The sizing of one compiled step (`keras_mp.jax.memory`: `jax.jit(...).lower().compile()` on
abstract arguments) runs on JAX only, so it stays with the backend-only parts in
`keras_mp.jax`; `memory_estimate`, the backend-neutral entry, imports it when called.
"""

from keras_mp.memory.blocks import SAVE, find_blocks, recompute_blocks
from keras_mp.memory.fit import FitReport, PolicyFit, will_it_fit
from keras_mp.memory.memory_estimate import (
    DEFAULT_POLICIES,
    POLICIES,
    MemoryReport,
    PolicyMemory,
    estimate_memory,
)
from keras_mp.memory.recompute import recompute_elementwise, saves_matmul_outputs

__all__ = [
    "DEFAULT_POLICIES",
    "FitReport",
    "MemoryReport",
    "POLICIES",
    "PolicyFit",
    "PolicyMemory",
    "SAVE",
    "estimate_memory",
    "find_blocks",
    "recompute_blocks",
    "recompute_elementwise",
    "saves_matmul_outputs",
    "will_it_fit",
]
