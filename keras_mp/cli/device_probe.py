"""What the harness reads off the machine it runs on: the device, its peak memory, the
backend's version."""

from __future__ import annotations

import os
import resource
import sys

__all__ = ["backend_version", "cpu_model", "device_and_memory", "on_gpu", "tf_cpu_tensor_peak"]


def device_and_memory(backend: str):
    """(device description, peak memory GiB, memory kind) for the current process."""
    if backend == "jax":
        import jax

        dev = jax.devices()[0]
        stats = dev.memory_stats() if dev.platform != "cpu" else None
        if stats and "peak_bytes_in_use" in stats:
            return dev.device_kind, stats["peak_bytes_in_use"] / 2**30, "device"
    elif backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "GPU")
            return name, tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**30, "device"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return cpu_model(), rss_kib / 2**20, "host_rss"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU ({os.cpu_count()} cores)"


def tf_cpu_tensor_peak(backend: str, reset: bool = False) -> int | None:
    """TensorFlow on CPU: the allocator's peak bytes in use (tensors only, unlike RSS) since
    the last reset; `reset=True` starts a new window. None elsewhere or if unsupported."""
    if backend != "tensorflow" or on_gpu(backend):
        return None
    from keras_mp.cli import records  # imports keras: not at module level

    if reset:
        records.reset_peak_memory("CPU")
    return records.peak_memory("CPU")


def on_gpu(backend: str) -> bool:
    if backend == "jax":
        import jax

        return jax.devices()[0].platform == "gpu"
    if backend == "tensorflow":
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    return False


def backend_version(backend: str) -> str:
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}.get(backend)
    return getattr(sys.modules.get(module), "__version__", "") if module else ""
