"""Deprecated aliases of `keras_mp.memory.memory_estimate`, kept so that older code runs.

`will_it_fit` read as if it were about `model.fit`; it estimates a train step's memory, and
is now `kmp.estimate_memory` (its report `kmp.MemoryReport`, one `PolicyMemory` a row).
The old names stay: `FitReport` and `PolicyFit` are the same classes, and `will_it_fit`
calls `estimate_memory` with the same arguments after a `DeprecationWarning`.

Example:

```python
report = kmp.estimate_memory(model, x_batch)   # was: kmp.will_it_fit(model, x_batch)
```
"""

from __future__ import annotations

import warnings

from keras_mp.memory.memory_estimate import (
    DEFAULT_POLICIES,
    POLICIES,
    MemoryReport,
    PolicyMemory,
    estimate_memory,
)

__all__ = ["DEFAULT_POLICIES", "FitReport", "POLICIES", "PolicyFit", "will_it_fit"]

FitReport = MemoryReport
PolicyFit = PolicyMemory


def will_it_fit(*args, **kwargs) -> MemoryReport:
    """Deprecated alias of `kmp.estimate_memory` (same arguments, same report).

    Returns:
        A `MemoryReport` (also importable as `FitReport`).
    """
    warnings.warn(
        "kmp.will_it_fit is renamed kmp.estimate_memory (same arguments and report); the old "
        "name is kept as an alias.",
        DeprecationWarning,
        stacklevel=2,
    )
    return estimate_memory(*args, **kwargs)
