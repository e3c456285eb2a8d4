"""Packaged YAML configurations (``demo_digits.yaml``: the ``make demo`` run)."""

__all__ = []
