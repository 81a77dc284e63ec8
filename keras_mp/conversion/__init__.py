"""Converting a model to a policy: `convert()` and `plan()`.

The face of the subpackage. Beside it: the conversion itself (`converter.py`), copying a
built model (`model_copy.py`), the run check that pins what fails in the low dtype
(`runcheck.py`, `trial.py`, `probe.py`), calibration on the user's data
(`calibration.py`, `confirm.py`) and the casts at pinned layers' boundaries
(`boundary.py`). What a keep-list entry matches is `keras_mp.keep_list`.
"""

from keras_mp.conversion.converter import apply_plan, convert, plan

__all__ = ["apply_plan", "convert", "plan"]
