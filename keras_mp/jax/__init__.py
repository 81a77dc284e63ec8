"""JAX-only parts of keras_mp, imported lazily by the backend-neutral modules on JAX."""
