"""Silencing our own expected warnings without making Python show others' again.

`warnings.catch_warnings()` and `warnings.simplefilter()` bump Python's filter version,
which clears every module's record of the warnings it has already shown: after one such
block, each Keras warning the process has shown once ("`shuffle=True` ... ignored", "The
structure of `inputs` doesn't match") shows again the next time it fires, so code that
converts or builds a few models printed Keras' warnings several times where stock Keras
prints them once. `ignoring` adds an "ignore" filter in front of the list for the block
and takes it out again without bumping the version: warnings inside the block are
dropped (and not recorded as shown), the record of those shown before is kept.

Example:

```python
from keras_mp.keras_glue.quiet import ignoring

with ignoring(UserWarning):
    policy = Policy("float16")   # its "no master weights" warning was given already
```
"""

from __future__ import annotations

import contextlib
import warnings

__all__ = ["ignoring"]


@contextlib.contextmanager
def ignoring(category: type[Warning] = Warning):
    """Ignores `category` warnings inside the block, leaving Python's record of shown
    warnings (and so Keras' show-once behaviour) as it was."""
    entry = ("ignore", None, category, None, 0)
    warnings.filters.insert(0, entry)
    try:
        yield
    finally:
        for i, item in enumerate(warnings.filters):
            if item is entry:
                del warnings.filters[i]
                break
