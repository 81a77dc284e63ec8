"""JAX-only parts of keras_mp, imported lazily by the backend-neutral modules on JAX.

- `memory`: the memory of a compiled train step without running it (`jax.jit(...).lower()`
  on abstract arguments): the sizing behind `kmp.estimate_memory` (`keras_mp.memory`), kept
  here with the other code that runs on JAX only.
- `xla`: keeping a tensor as it is for the backward pass under XLA.

Nothing is imported here: `import keras_mp` never imports JAX on another backend.
"""

__all__ = ["memory", "xla"]
