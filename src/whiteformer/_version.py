"""The package version (one place; read by the package, checkpoints and the CLI)."""
__version__ = "0.1.0"
