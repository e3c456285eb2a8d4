"""Models built from whiteformer's attention layers, with a timm-style registry."""
from .registry import create_model, list_models, register_model  # noqa: F401
from . import _load_families  # noqa: F401,E402
