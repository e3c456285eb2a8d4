"""Models built from whiteformer's attention layers, with a timm-style registry
(``create_model``, ``list_models``) and transformers-style ``from_pretrained``."""
from .registry import list_models, register_model  # noqa: F401
from . import _load_families  # noqa: F401,E402
from .factory import create_model, from_pretrained, from_transformers_vit, resolve_model_dir  # noqa: F401,E402

__all__ = ["create_model", "list_models", "register_model", "from_pretrained", "from_transformers_vit",
           "resolve_model_dir"]
