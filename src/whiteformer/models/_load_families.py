"""Imports every model family so that their ``@register_model`` entry points are registered.
Each family adds one import line here."""
