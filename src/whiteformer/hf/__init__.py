"""whiteformer models in Hugging Face ``transformers`` (optional extra: ``pip install whiteformer[hf]``).

The Auto classes know whiteformer's ``model_type`` s as soon as ``transformers`` loads them in a
process that imported ``whiteformer`` (``import whiteformer`` installs a post-import hook; it imports
nothing of ``transformers`` itself), and any folder whiteformer saved loads without importing it at
all through ``trust_remote_code=True`` (its ``config.json`` has an ``auto_map``)::

    import whiteformer  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                  init_kwargs=dict(vocab_size=256, dim=64, depth=2, num_heads=4))
    model = AutoModelForCausalLM.from_config(config)
    out = model.generate(input_ids, max_new_tokens=20)   # state in a WhiteformerCache

``model_type`` s and their classes (``AutoModel`` = headless, hidden states only):

- ``"whiteformer-tost-lm"``: :class:`ToSTModel`, :class:`ToSTForCausalLM`;
- ``"whiteformer-gpt"``: :class:`WhiteformerGPTModel`, :class:`WhiteformerGPTForCausalLM`;
- ``"whiteformer-vision"``: :class:`WhiteformerVisionModel`, :class:`WhiteformerForImageClassification`.

The configurations and model classes (:mod:`whiteformer.hf.modeling`) are imported on first use
(importing the package alone needs no ``transformers``), and registered with ``AutoConfig`` /
``AutoModel*`` once ``transformers``' ``configuration_auto`` / ``modeling_auto`` is loaded.
:data:`LORA_TARGET_MODULES` are the default LoRA targets ``peft`` uses for each ``model_type``
(registered when ``peft`` loads).
"""
import importlib

from .._import_hooks import when_imported
from .lora import LORA_TARGET_MODULES

_CONFIGURATION = ("WhiteformerConfig", "ToSTLMConfig", "WhiteformerGPTConfig", "WhiteformerDecoderConfig",
                  "WhiteformerVisionConfig")
_MODELING = ("WhiteformerPreTrainedModel", "ToSTModel", "ToSTForCausalLM", "WhiteformerGPTModel",
             "WhiteformerGPTForCausalLM", "WhiteformerDecoderModel", "WhiteformerDecoderForCausalLM",
             "WhiteformerVisionModel", "WhiteformerForImageClassification")

__all__ = ["WhiteformerCache", *_CONFIGURATION, "LORA_TARGET_MODULES", *_MODELING]


def _with_transformers(module: str):
    """The submodule ``module`` of this package, which imports ``transformers``."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ImportError("whiteformer.hf needs Hugging Face transformers: pip install whiteformer[hf]") from err
    return importlib.import_module(module, __name__)


def __getattr__(name: str):
    """The configurations, model classes and the cache, imported on first use (they import
    ``transformers``; the package itself does not, so :mod:`whiteformer.models` reads and writes
    the formats of :mod:`whiteformer.models.formats` without it)."""
    if name in _CONFIGURATION:
        return getattr(_with_transformers(".configuration"), name)
    if name in _MODELING:
        return getattr(_with_transformers(".modeling"), name)
    if name == "WhiteformerCache":
        return _with_transformers(".cache").WhiteformerCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register_configs() -> None:
    from transformers.models.auto.configuration_auto import AutoConfig

    from .configuration import ToSTLMConfig, WhiteformerDecoderConfig, WhiteformerGPTConfig, WhiteformerVisionConfig

    for config in (ToSTLMConfig, WhiteformerGPTConfig, WhiteformerDecoderConfig, WhiteformerVisionConfig):
        AutoConfig.register(config.model_type, config, exist_ok=True)


# registered once transformers' Auto modules load (the model classes register themselves at the end
# of their module, which needs modeling_auto)
when_imported("transformers.models.auto.configuration_auto", _register_configs)
when_imported("transformers.models.auto.modeling_auto", lambda: importlib.import_module(".modeling", __name__))
when_imported("peft.utils.constants", lambda: importlib.import_module(".lora", __name__).register_with_peft())
