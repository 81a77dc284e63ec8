"""What importing keras_mp does to Keras, and what it reads from Keras' private side.

- `patches`: every change `import keras_mp` makes in Keras (`compile`, the optimizers'
  `apply`, `clone_model`, `Layer.from_config`, TensorFlow's log level), `KERAS_MP_NO_PATCH`,
  `uninstall()`. `kmp.patches` is this module.
- `keras_internals`: the one door to `keras.src`, with a fallback per Keras version.
- `backend_logs`: TensorFlow's C++ log lines filtered while it loads.
- `quiet`: warnings keras_mp knows to be harmless, silenced where they arise.
- `extras`: optional dependencies and the install command that brings each, and the
  backend Keras will start (checked before it does).
- `archive`: a `.keras` file's archive checked and its config read, without Keras.
- `source_handles`: a converted copy's weak references to the source model's layers, read
  by the compile patch.
- `scoped`: a change to Keras installed for one `with` block only.

Nothing is imported here: `patches` must run before Keras loads (it sets TensorFlow's log
level), and importing `keras_internals` imports Keras.
"""

__all__ = [
    "archive",
    "backend_logs",
    "extras",
    "keras_internals",
    "patches",
    "quiet",
    "scoped",
    "source_handles",
]
