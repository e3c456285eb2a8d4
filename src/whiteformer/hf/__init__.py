"""whiteformer models in Hugging Face ``transformers`` (optional extra: ``pip install whiteformer[hf]``).

Importing this module registers the configurations and models with the Auto classes::

    import whiteformer.hf  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("whiteformer-tost-lm", model_name="tost_lm_base",
                                  init_kwargs=dict(vocab_size=256, dim=64, depth=2, num_heads=4))
    model = AutoModelForCausalLM.from_config(config)
    out = model.generate(input_ids, max_new_tokens=20)   # state in a WhiteformerCache

``model_type`` s: ``"whiteformer-tost-lm"`` (:class:`ToSTForCausalLM`), ``"whiteformer-gpt"``
(:class:`WhiteformerGPTForCausalLM`), ``"whiteformer-vision"``
(:class:`WhiteformerForImageClassification`). Directories written by whiteformer's own
``save_pretrained`` load with ``AutoModel*.from_pretrained`` and the other way round.
"""
try:
    import transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in a subprocess test
    raise ImportError("whiteformer.hf needs Hugging Face transformers: pip install whiteformer[hf]") from err

from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification

from .cache import WhiteformerCache
from .configuration import ToSTLMConfig, WhiteformerConfig, WhiteformerGPTConfig, WhiteformerVisionConfig
from .modeling import (ToSTForCausalLM, WhiteformerForImageClassification, WhiteformerGPTForCausalLM,
                       WhiteformerPreTrainedModel)

__all__ = ["WhiteformerCache", "WhiteformerConfig", "ToSTLMConfig", "WhiteformerGPTConfig", "WhiteformerVisionConfig",
           "WhiteformerPreTrainedModel", "ToSTForCausalLM", "WhiteformerGPTForCausalLM",
           "WhiteformerForImageClassification"]


def _register() -> None:
    for config in (ToSTLMConfig, WhiteformerGPTConfig, WhiteformerVisionConfig):
        AutoConfig.register(config.model_type, config, exist_ok=True)
    AutoModelForCausalLM.register(ToSTLMConfig, ToSTForCausalLM, exist_ok=True)
    AutoModelForCausalLM.register(WhiteformerGPTConfig, WhiteformerGPTForCausalLM, exist_ok=True)
    AutoModelForImageClassification.register(WhiteformerVisionConfig, WhiteformerForImageClassification,
                                             exist_ok=True)


_register()
