"""What `keras-mp compare` records while training: per-epoch values and peak device memory."""

from __future__ import annotations

import time

import keras
import numpy as np

from keras_mp.cli.jsonl import emit  # where the harness and the scripts import it from

__all__ = ["EpochRecorder", "emit", "peak_memory", "reset_peak_memory"]


def reset_peak_memory(tf_device: str = "GPU") -> None:
    """Starts a new peak-memory window where the backend supports it (TensorFlow).

    Args:
        tf_device: TensorFlow device type whose allocator to reset: `"GPU"` (the first GPU,
            if any) or `"CPU"` (TensorFlow's CPU allocator: tensors only, unlike RSS).
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        for d in tf.config.list_logical_devices(tf_device)[:1]:
            try:
                tf.config.experimental.reset_memory_stats(d.name)
            except (ValueError, RuntimeError):  # an allocator without statistics
                pass


def peak_memory(tf_device: str = "GPU") -> int | None:
    """Peak device memory in bytes where the backend reports it, else None.

    TensorFlow: the peak of the first `tf_device` (`"GPU"`, or `"CPU"` for TensorFlow's CPU
    allocator) since `reset_peak_memory(tf_device)`. JAX (GPUs) cannot reset its counter, so
    there it is the peak of the whole process so far (an upper bound for later modes).
    """
    try:
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            for d in tf.config.list_logical_devices(tf_device)[:1]:
                return int(tf.config.experimental.get_memory_info(d.name)["peak"])
        elif keras.backend.backend() == "jax":
            import jax

            stats = jax.devices()[0].memory_stats()
            if stats and "peak_bytes_in_use" in stats:
                return int(stats["peak_bytes_in_use"])
    except (ValueError, RuntimeError, AttributeError):
        pass
    return None


class EpochRecorder(keras.callbacks.Callback):
    """Per-epoch losses, train time, and the fraction of weights an epoch left unchanged.

    Args:
        on_batch: optional callable run after every training batch (progress bars).
    """

    def __init__(self, on_batch=None):
        super().__init__()
        self.on_batch = on_batch
        self.epochs: list[dict] = []

    def _weights(self):
        from keras_mp.lean import LeanOptimizer

        opt = getattr(self.model, "optimizer", None)
        if isinstance(opt, LeanOptimizer) and opt.built:  # bfloat16 + compensation
            return [np.asarray(w) for w in opt.weights_float32()]
        return [np.array(v.value) for v in self.model.trainable_variables]

    def on_epoch_begin(self, epoch, logs=None):
        self._before = self._weights()
        self._t0 = time.perf_counter()
        self._t1 = None

    def on_train_batch_end(self, batch, logs=None):
        if self.on_batch is not None:
            self.on_batch()

    def on_test_begin(self, logs=None):  # validation starts: the epoch's training is done
        self._t1 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        t1 = self._t1 or time.perf_counter()
        after = self._weights()
        same = sum(int(np.sum(a == b)) for a, b in zip(after, self._before, strict=True))
        logs = logs or {}
        self.epochs.append(
            {
                "train_loss": float(logs.get("loss", float("nan"))),
                "train_accuracy": float(logs.get("accuracy", float("nan"))),
                "val_loss": float(logs.get("val_loss", float("nan"))),
                "val_accuracy": float(logs.get("val_accuracy", float("nan"))),
                "train_seconds": t1 - self._t0,
                "frozen_fraction": same / max(1, sum(a.size for a in after)),
            }
        )
