"""A change to Keras installed for the duration of a `with` block only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["installed_for_block"]


@contextlib.contextmanager
def installed_for_block(
    install: Callable[[], None], uninstall: Callable[[], None], installed: Callable[[], bool]
) -> Iterator[None]:
    """`install()` for the duration of a `with` block, then `uninstall()`; nothing to do
    when `installed()` already (the change stays as it was).

    Example:

    >>> from keras_mp.saving import plan
    >>> with installed_for_block(plan.install, plan.uninstall, plan.installed):
    ...     pass
    """
    if installed():
        yield
        return
    install()
    try:
        yield
    finally:
        uninstall()
