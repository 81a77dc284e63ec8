"""Saving: atomic writes, and loading that brings the precision plan back.

`kmp.saving` (this face) is what `keras_mp.saving` was before the regroup (issue 53).

- `atomic`: `save_model` / `save_weights` write to a temporary file and rename it.
- `load`: `load_model` / `load_weights` (the plan re-applied, `reapply_plan`).
- `plan`: a converted model's precision plan saved in its config (a Functional model's
  too) and applied again when it is made from it (`reapply_plan`).
- `sublayer_dtypes`: sublayers made in a custom layer's `__init__` load in its dtype
  (installed by `keras_mp.keras_glue.patches`, with `plan`).
"""

from keras_mp.saving.load import load_model, load_weights, reapply_plan, save_model, save_weights

__all__ = ["load_model", "load_weights", "reapply_plan", "save_model", "save_weights"]
