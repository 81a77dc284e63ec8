"""TensorFlow-only parts of keras_mp.

Modules here may use TensorFlow, but import it inside functions so that
`import keras_mp` never imports TensorFlow on another backend.
"""

from keras_mp.tf.export import export_saved_model, float32_clone

__all__ = ["export_saved_model", "float32_clone"]
