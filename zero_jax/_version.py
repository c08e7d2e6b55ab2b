"""The package version, in one place below every floor (``zero_jax.__version__`` re-exports it)."""

__version__ = "0.1.0"
