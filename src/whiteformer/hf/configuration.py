"""``transformers`` configurations of whiteformer models.

A configuration names a registered whiteformer model (``model_name``, see
``whiteformer.list_models()``) and its constructor arguments (``init_kwargs``) -- the same two
fields as the ``config.json`` that ``whiteformer``'s own ``save_pretrained`` writes, so a directory
saved either way loads either way. One ``model_type`` per family:

- ``"whiteformer-tost-lm"``: causal ToST language models (``tost_lm_*``);
- ``"whiteformer-gpt"``: the softmax GPT baseline (``gpt_*``);
- ``"whiteformer-decoder"``: the Llama-style decoder, softmax, causal TSSA or hybrid (``decoder_base``,
  ``tost_decoder_base``);
- ``"whiteformer-vision"``: image classifiers (``tost_*``, ``dmst_*``, ``eca_*``, ``deit_*``,
  ``crate_*``, ``xcit_*``, ``vit_cab_*``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from transformers import PretrainedConfig

from .._checks import check_instance, is_int
from ..models.formats.remote_code import auto_map, write_remote_code
from ..models.registry import list_models
from ..models.size import max_params

__all__ = ["WhiteformerConfig", "ToSTLMConfig", "WhiteformerGPTConfig", "WhiteformerDecoderConfig",
           "WhiteformerVisionConfig"]

# keys of whiteformer's own config.json that are not configuration
_OWN_FORMAT_KEYS = ("format", "architecture", "model_class", "version", "num_classes", "model_args", "pretrained_cfg")


def _local_config_json(path) -> Any:
    """The parsed ``config.json`` of a local model folder; None when there is none or it is not JSON."""
    try:
        return json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, TypeError, ValueError):
        return None


class WhiteformerConfig(PretrainedConfig):
    """Base: ``model_name`` (a registered whiteformer model) + ``init_kwargs`` (its constructor
    overrides, e.g. ``dict(vocab_size=50304, depth=6)``); other keyword arguments are the usual
    ``PretrainedConfig`` ones."""

    model_type = "whiteformer"
    default_model_name = ""

    def __init__(self, model_name: Optional[str] = None, init_kwargs: Optional[Dict[str, Any]] = None, **kwargs):
        for key in _OWN_FORMAT_KEYS:
            kwargs.pop(key, None)
        model_name = model_name or self.default_model_name
        if not isinstance(model_name, str) or model_name not in list_models():
            raise ValueError(f"model_name {model_name!r} is not a registered whiteformer model; see "
                             f"whiteformer.list_models()")
        check_instance(init_kwargs, "init_kwargs", dict, "a dict of constructor arguments", optional=True)
        kwargs.pop("auto_map", None)  # always ours (models.formats.remote_code), never another module's
        super().__init__(**kwargs)  # (resets the instance's attributes: set ours after it)
        self.auto_map = auto_map(self.model_type)
        self.model_name = model_name
        self.init_kwargs = dict(init_kwargs or {})
        self._mirror()

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """``PretrainedConfig.get_config_dict``; a ``config.json`` that is not a JSON object (an array,
        a number) is a ``ValueError`` naming it, not a ``TypeError`` from ``cls(**config)``."""
        try:
            config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        except TypeError:  # older transformers (5.17) index the loaded JSON before returning it
            config_dict = _local_config_json(pretrained_model_name_or_path)
            if config_dict is None or isinstance(config_dict, dict):
                raise
        if not isinstance(config_dict, dict):
            raise ValueError(f"the config.json of {str(pretrained_model_name_or_path)!r} must hold a JSON object "
                             f"(model_name, init_kwargs, ...), got a {type(config_dict).__name__}")
        return config_dict, kwargs

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig") -> None:
        """Nothing to do: every whiteformer configuration carries its ``auto_map`` (the folder's
        ``whiteformer_auto.py`` module, written by ``save_pretrained``); ``transformers`` calls this
        after loading remote code and would otherwise copy this package's source into saved folders."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PretrainedConfig.save_pretrained`` plus ``whiteformer_auto.py``, the module its ``auto_map``
        names (so the folder loads with ``trust_remote_code=True`` without ``import whiteformer``)."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)
        return out

    #: (whiteformer constructor argument, transformers attribute) pairs copied by :meth:`_mirror`
    mirrored = ()

    def _mirror(self) -> None:
        """Copy the constructor arguments ``transformers`` looks for under its own names."""
        for ours, theirs in self.mirrored:
            if ours in self.init_kwargs:
                setattr(self, theirs, self.init_kwargs[ours])


class _LMConfig(WhiteformerConfig):
    def __init__(self, model_name: Optional[str] = None, init_kwargs: Optional[Dict[str, Any]] = None, **kwargs):
        use_cache = bool(kwargs.pop("use_cache", True))
        tie = bool(kwargs.pop("tie_word_embeddings", True))
        super().__init__(model_name, init_kwargs, **kwargs)
        self.use_cache = use_cache
        self.tie_word_embeddings = tie  # wte is lm_head

    mirrored = (("vocab_size", "vocab_size"), ("dim", "hidden_size"), ("depth", "num_hidden_layers"),
                ("num_heads", "num_attention_heads"), ("max_len", "max_position_embeddings"),
                ("eos_token_id", "eos_token_id"))


class ToSTLMConfig(_LMConfig):
    """Causal ToST language model (``tost_lm_base`` / ``_medium`` / ``_large``)."""

    model_type = "whiteformer-tost-lm"
    default_model_name = "tost_lm_base"

    def __init__(self, model_name: Optional[str] = None, init_kwargs: Optional[Dict[str, Any]] = None, **kwargs):
        super().__init__(model_name, init_kwargs, **kwargs)  # (transformers only keeps an __init__ defined here)


class WhiteformerGPTConfig(_LMConfig):
    """Softmax GPT baseline in the same shell (``gpt_base`` / ``_medium`` / ``_large``)."""

    model_type = "whiteformer-gpt"
    default_model_name = "gpt_base"

    def __init__(self, model_name: Optional[str] = None, init_kwargs: Optional[Dict[str, Any]] = None, **kwargs):
        super().__init__(model_name, init_kwargs, **kwargs)  # (transformers only keeps an __init__ defined here)


class WhiteformerDecoderConfig(_LMConfig):
    """Llama-style decoder (``decoder_base``, ``tost_decoder_base``); ``tie_word_embeddings`` follows
    ``init_kwargs["tie_embeddings"]`` (an untied head stays untied on loading)."""

    model_type = "whiteformer-decoder"
    default_model_name = "decoder_base"

    def __init__(self, model_name: Optional[str] = None, init_kwargs: Optional[Dict[str, Any]] = None, **kwargs):
        super().__init__(model_name, init_kwargs, **kwargs)  # (transformers only keeps an __init__ defined here)
        self._mirror()

    mirrored = _LMConfig.mirrored + (("num_kv_heads", "num_key_value_heads"),
                                     ("intermediate_size", "intermediate_size"),
                                     ("tie_embeddings", "tie_word_embeddings"))


class WhiteformerVisionConfig(WhiteformerConfig):
    """Image classifier of the zoo. ``num_labels`` follows ``init_kwargs["num_classes"]`` (the model's
    default when unset); a ``num_labels`` passed in (``from_pretrained(d, num_labels=5,
    ignore_mismatched_sizes=True)``, ``for_model(..., num_labels=5)``) or ``id2label`` set afterwards
    sets ``num_classes``, so the head has that many outputs, as in ``transformers``' own classifiers."""

    model_type = "whiteformer-vision"
    default_model_name = "tost_t12_p16"

    def __init__(self, model_name: Optional[str] = None, init_kwargs: Optional[Dict[str, Any]] = None, **kwargs):
        labels = kwargs.get("num_labels")  # (beside a saved id2label, as transformers: a warning, not the count)
        if is_int(labels) and labels > 0 and "id2label" not in kwargs \
                and (init_kwargs is None or isinstance(init_kwargs, dict)):
            init_kwargs = {**(init_kwargs or {}), "num_classes": int(labels)}
        super().__init__(model_name, init_kwargs, **kwargs)  # (transformers only keeps an __init__ defined here)

    def __setattr__(self, key: str, value: Any) -> None:
        super().__setattr__(key, value)
        if key == "id2label" and isinstance(value, dict) and value and isinstance(self.__dict__.get("init_kwargs"), dict):
            self.init_kwargs["num_classes"] = len(value)  # (num_labels' setter sets id2label too)

    mirrored = (("img_size", "image_size"), ("patch_size", "patch_size"), ("in_chans", "num_channels"),
                ("embed_dim", "hidden_size"), ("depth", "num_hidden_layers"))

    def _mirror(self) -> None:
        super()._mirror()
        classes = self.init_kwargs.get("num_classes")
        # (a count past the parameter bound is left to the model's size check: transformers would first
        # build a label map with that many entries)
        if is_int(classes) and 0 < classes <= max_params() and self.num_labels != classes:
            self.num_labels = classes
