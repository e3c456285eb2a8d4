"""whiteformer: efficient, interpretable ("white-box") attention for transformers.

Layout (in the spirit of flash-linear-attention):

- ``whiteformer.ops``: functional operators, each with a plain reference version in
  ``whiteformer.ops.reference``;
- ``whiteformer.attention``: ``nn.Module`` layers with timm's ``(B, N, C)`` contract and a
  name registry (``build``, ``list_attention``);
- ``whiteformer.models``: model zoo with a timm-style registry (``create_model``, ``list_models``).
"""
from . import ops  # noqa: F401
from . import attention  # noqa: F401
from .models import create_model, list_models  # noqa: F401

__version__ = "0.1.0"
