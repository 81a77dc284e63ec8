"""The package version, in one place (`keras_mp.__version__`)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
