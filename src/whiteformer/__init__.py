"""whiteformer: efficient, interpretable ("white-box") attention for transformers.

Layout (in the spirit of flash-linear-attention and timm; each layer imports only the ones above it):

- ``whiteformer.ops``: functional operators, each with a plain reference version in
  ``whiteformer.ops.reference``;
- ``whiteformer.attention``: ``nn.Module`` layers with timm's ``(B, N, C)`` contract and a
  name registry (``build``, ``list_attention``);
- ``whiteformer.layers``: building blocks shared by the models (patch grid, position-embedding
  resampling, intermediate features);
- ``whiteformer.models``: model zoo with a timm-style registry (``create_model``, ``list_models``)
  and ``from_pretrained``;
- ``whiteformer.compress``: attention compression (IrrAtt, TruncAtt, CP SlimAtt): its layers, MACs,
  decompositions and model surgery; imported here so that its layers and surgery are registered;
- ``whiteformer.analysis``: white-box measurements, ``whiteformer.hf``: transformers integration;
- ``whiteformer.app``: the ``whiteformer`` command and training, which the library never imports.
"""
from ._version import __version__  # noqa: F401
from . import ops  # noqa: F401
from . import attention  # noqa: F401
from .models import create_model, from_pretrained, list_models  # noqa: F401
from . import compress  # noqa: F401  (registers the compressed layers and their model surgery)

__all__ = ["__version__", "ops", "attention", "create_model", "from_pretrained", "list_models"]


def _load_hf() -> None:
    import importlib

    importlib.import_module("whiteformer.hf")


def _install_hooks() -> None:
    """Register with ``transformers``' Auto classes and ``peft``'s LoRA table when (and only if)
    those libraries are imported: ``import whiteformer`` imports neither (see ``whiteformer.hf``)."""
    from ._import_hooks import when_imported

    when_imported("transformers.models.auto.configuration_auto", _load_hf)
    when_imported("transformers.models.auto.modeling_auto", _load_hf)  # (so whiteformer.hf can wait for it)
    when_imported("peft.utils.constants", _load_hf)


_install_hooks()
