"""whiteformer models as ``transformers`` ``PreTrainedModel`` s.

Each wrapper builds the whiteformer model named by its configuration (``create_model(model_name,
**init_kwargs)``) and *is a second view of it*: the two share their tables of sub-modules,
parameters and buffers, so the wrapper's ``state_dict`` keys are whiteformer's own
(``transformer.h.0.attn.qkv.weight``, ``blocks.0.attn.qkv.weight``, ...) and one
``model.safetensors`` loads both ways (``whiteformer.create_model(..., checkpoint_path=d)`` and
``AutoModel*.from_pretrained(d)``). The wrapper's forward calls the whiteformer model's public
methods (``forward``, ``prefill``, ``step``); ``.whiteformer`` returns that model.

- :class:`ToSTForCausalLM`, :class:`WhiteformerGPTForCausalLM`: ``forward(input_ids,
  attention_mask, labels, past_key_values / cache, use_cache)`` -> ``CausalLMOutputWithPast``
  with ``transformers``' shifted-label loss; ``generate()`` (greedy, sampling, beam search,
  left-padded batches) carries the state in a :class:`~whiteformer.hf.cache.WhiteformerCache`.
- :class:`WhiteformerForImageClassification`: ``forward(pixel_values, labels)`` ->
  ``ImageClassifierOutput``.
- headless (``AutoModel``): :class:`ToSTModel`, :class:`WhiteformerGPTModel` ->
  ``BaseModelOutputWithPast`` (``last_hidden_state`` after ``ln_f``), :class:`WhiteformerVisionModel`
  -> ``BaseModelOutputWithPooling`` (the tokens of ``forward_features`` and the pooled features).

``output_hidden_states=True`` (every class; default ``config.output_hidden_states``, as
``from_pretrained(d, output_hidden_states=True)`` sets it) adds ``hidden_states``: the embeddings and one tensor per
block, as ``transformers`` -- for the language models the last entry is after the final norm (as
GPT-2 / Llama), for the vision models every entry is a raw block output (as ViT), (B, P + N, D)
with the model's own tokens (DeiT / CRATE: class token first; the ToST shell: patch tokens only,
its class token joins after the blocks). Saved folders carry an ``auto_map`` and
``whiteformer_auto.py`` (:mod:`whiteformer.models.formats.remote_code`).
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
    ImageClassifierOutput,
)

from .._checks import is_int
from .._files import check_path, replace_folder
from .._import_hooks import when_imported
from ..models.factory import create_model
from ..models.formats.remote_code import REMOTE_CODE_NAME, write_remote_code
from ..models.load import check_file_dtypes
from ..models.model_card import CARD_NAME
from ..models.save import card_is_ours, complete_hub_folder
from .cache import WhiteformerCache
from .configuration import (
    ToSTLMConfig,
    WhiteformerConfig,
    WhiteformerDecoderConfig,
    WhiteformerGPTConfig,
    WhiteformerVisionConfig,
)
from .generation import (
    check_generation_config,
    check_prompt_mask,
    check_user_cache,
    kept_positions,
    refuse_continuous_batching,
)
from .hub import file_times, push_folder
from .labels import check_classification_labels, check_lm_labels
from .packing import mask_document_starts, packed_cu_seqlens

__all__ = ["WhiteformerPreTrainedModel", "ToSTModel", "ToSTForCausalLM", "WhiteformerGPTModel",
           "WhiteformerGPTForCausalLM", "WhiteformerDecoderModel", "WhiteformerDecoderForCausalLM",
           "WhiteformerVisionModel", "WhiteformerForImageClassification"]


def _output(cls, **fields):
    """Build a ``ModelOutput``; the cache field is ``cache`` in recent ``transformers`` and
    ``past_key_values`` before."""
    if "cache" in fields and "cache" not in cls.__dataclass_fields__:
        fields["past_key_values"] = fields.pop("cache")
    return cls(**fields)


def _refuse(output_attentions, return_dict, inputs_embeds=None) -> None:
    """Clear errors for the ``transformers`` options the wrappers do not implement."""
    for name, value in (("output_attentions", output_attentions), ("inputs_embeds", inputs_embeds)):
        if value is not None and value is not False:
            raise ValueError(f"{name} is not supported by whiteformer models; leave it unset")
    if return_dict is False:
        raise ValueError("return_dict=False is not supported; read the fields of the returned output")


def _want_hidden_states(model, output_hidden_states: Optional[bool]) -> bool:
    """``output_hidden_states``, else the configuration's (``from_pretrained(d, output_hidden_states=True)``),
    as every ``transformers`` model reads it."""
    if output_hidden_states is None:
        output_hidden_states = getattr(model.config, "output_hidden_states", False)
    return bool(output_hidden_states)


def _check_input_ids(net: nn.Module, input_ids, values: bool = True) -> None:
    """``input_ids``: a (B, T) integer tensor of ids in the vocabulary (errors name ``input_ids``;
    ``values=False``: the ids are not read, inside a ``generate()`` that checked its prompt)."""
    if input_ids is None:
        raise ValueError("input_ids is required: a (B, T) tensor of token ids")
    net._check_idx(input_ids, "input_ids", values=values)


def _refuse_labels(model, kwargs, head_class: str) -> None:
    """A headless model computes no loss: ``labels`` are refused, not silently dropped."""
    if kwargs.get("labels") is not None:
        raise ValueError(f"labels: {type(model).__name__} is headless (hidden states only, no loss); load the model "
                         f"with {head_class} to train on labels")


def _written(variant: Optional[str] = None) -> "re.Pattern":
    """The names ``save_pretrained(..., variant=variant)`` writes: the configs, the weights (one file or
    shards) and the shard index, with ``transformers``' variant infix (``model.fp16.safetensors``,
    ``model.fp16-00001-of-00002.safetensors``, ``model.safetensors.index.fp16.json``)."""
    v = rf"\.{re.escape(variant)}" if variant else ""
    return re.compile(rf"(generation_)?config\.json|model{v}(-\d{{5}}-of-\d{{5}})?\.safetensors"
                      rf"|model\.safetensors\.index{v}\.json")


class WhiteformerPreTrainedModel(PreTrainedModel):
    """Shared wrapper: builds ``create_model(config.model_name, **config.init_kwargs)`` and shares
    its parameters (see the module docstring)."""

    config_class = WhiteformerConfig
    base_model_prefix = ""
    supports_gradient_checkpointing = True  # the whiteformer model's set_grad_checkpointing
    family: Optional[str] = None  # expected ``hf_model_type`` of the whiteformer model class
    _no_split_modules = ["LMBlock", "DecoderBlock", "Block", "ClassAttentionBlock", "CRATEBlock"]  # the wrapped models' residual blocks

    def __init__(self, config: WhiteformerConfig):
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, got {type(config).__name__}")
        super().__init__(config)
        net = create_model(config.model_name, **config.init_kwargs)
        family = getattr(net, "hf_model_type", None)
        if family != self.family:
            raise ValueError(f"model_name {config.model_name!r} is a {family or 'non-transformers'} model, not a "
                             f"{self.family} model; use the configuration class of its family")
        config.init_kwargs = dict(net.init_kwargs)  # resolved: every constructor argument
        config._mirror()
        # one set of tensors: the wrapper's tables are the whiteformer model's
        object.__setattr__(self, "_modules", net._modules)
        object.__setattr__(self, "_parameters", net._parameters)
        object.__setattr__(self, "_buffers", net._buffers)
        object.__setattr__(self, "_non_persistent_buffers_set", net._non_persistent_buffers_set)
        self.__dict__["_whiteformer"] = net
        if not any(t.is_meta for t in self.state_dict().values()):
            for t in list(self.parameters()) + list(self.buffers()):
                t._is_hf_initialized = True  # built with whiteformer's own init: keep it
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, then each layer's own state-dict load hook runs once
        (``transformers`` sets tensors directly; e.g. ECAttention reads its sketch seed there)."""
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if source is not None:
            check_path(source, "pretrained_model_name_or_path")
        out = super().from_pretrained(*args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        if source is not None:  # integer weights where the model has floats: refused, not cast
            check_file_dtypes(model.whiteformer, source)
        with torch.no_grad():
            model.whiteformer.load_state_dict(model.whiteformer.state_dict())
        return out

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel") -> None:
        """Nothing to do: the saved ``config.json`` always names ``whiteformer_auto.py`` in its
        ``auto_map`` (``transformers`` calls this after loading remote code and would otherwise copy
        this package's source files into every folder saved afterwards)."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained`` plus the folder's ``whiteformer_auto.py`` (what ``auto_map``
        names, so that ``trust_remote_code=True`` loads it without ``import whiteformer``), written into a
        new folder that then replaces the model in ``save_directory`` as one unit
        (:func:`whiteformer._files.staged_folder`): a reader never sees one save's config with another's
        weights, a failed save (a full disk) leaves the model already there, and a second save into the
        folder while one is writing is refused. As for any ``transformers`` model, the files it writes
        (``config.json``, ``generation_config.json``, ``model*.safetensors``, the shard index) are
        replaced and the folder's other files kept; a link there is replaced, never written through.

        For the Hub's two audiences the folder also gets timm's ``config.json`` fields (``architecture``,
        ``num_classes``, ``model_args``, ``pretrained_cfg``; ``transformers`` ignores them on loading) and
        the model card ``README.md`` of :func:`whiteformer.models.save_pretrained` (a README of the
        user's is kept). With ``push_to_hub=True`` the complete folder is uploaded after the save
        (:func:`whiteformer.hf.hub.push_folder`)."""
        written = _written(kwargs.get("variant"))
        folder = Path(check_path(save_directory, "save_directory"))
        main = args[0] if args else kwargs.get("is_main_process", True)
        push = bool(kwargs.pop("push_to_hub", False)) and main  # uploaded below, once the folder is complete
        hub = {key: kwargs.pop(key) for key in ("commit_message", "create_pr", "private") if key in kwargs}
        repo_id = kwargs.pop("repo_id", folder.name)  # (named after the folder, not its stage)
        before = file_times(folder) if push else {}
        card = card_is_ours(folder / CARD_NAME)
        out = []

        def write(stage: Path) -> None:
            out.append(super(WhiteformerPreTrainedModel, self).save_pretrained(stage, *args, **kwargs))
            write_remote_code(stage)
            complete_hub_folder(self.whiteformer, stage, card=card)

        replace_folder(save_directory, write, keep=lambda name: not written.fullmatch(name)
                       and name != REMOTE_CODE_NAME and not (card and name == CARD_NAME))
        if push:
            push_folder(folder, before, repo_id, token=kwargs.get("token"), tags=self.model_tags, **hub)
        return out[0]

    def push_to_hub(self, repo_id: str, *, commit_message: Optional[str] = None,
                    commit_description: Optional[str] = None, private: Optional[bool] = None, token=None,
                    revision: Optional[str] = None, create_pr: bool = False, max_shard_size="50GB",
                    tags=None):
        """``transformers``' ``push_to_hub`` (same arguments): the folder :meth:`save_pretrained` writes
        (timm's fields, ``whiteformer_auto.py``, whiteformer's model card with ``tags``; a card the
        repository already has stays) uploaded in one commit (:func:`whiteformer.hf.hub.push_folder`).
        Returns the commit info."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags = list(self.model_tags or []) + [t for t in tags if t not in (self.model_tags or [])]
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "model"
            self.save_pretrained(folder, max_shard_size=max_shard_size)
            return push_folder(folder, {}, repo_id, token=token, private=private, commit_message=commit_message,
                               commit_description=commit_description, create_pr=create_pr, revision=revision,
                               tags=tags)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1) -> None:
        """``gradient_checkpointing_enable()`` / ``Trainer(gradient_checkpointing=True)``: every block
        of the whiteformer model is checkpointed with ``transformers``' checkpoint function
        (``use_reentrant=False`` unless its kwargs say otherwise)."""
        if every_n_layers != 1:
            raise ValueError(f"whiteformer models checkpoint every block (every_n_layers=1), got {every_n_layers}")
        self.whiteformer.set_grad_checkpointing(bool(enable), gradient_checkpointing_func if enable else None)

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the blocks are checkpointed (read by ``is_gradient_checkpointing``)."""
        return bool(getattr(self.whiteformer, "grad_checkpointing", False))

    @property
    def whiteformer(self) -> nn.Module:
        """The whiteformer model (same parameters as this wrapper)."""
        return self.__dict__["_whiteformer"]

    def train(self, mode: bool = True):
        super().train(mode)
        self.whiteformer.training = mode
        return self

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Weights ``from_pretrained`` did not find in the checkpoint get whiteformer's own init
        (from a freshly built model); everything else is left as loaded."""
        if module is not self:
            return
        todo = [(n, t) for n, t in list(self.named_parameters()) + list(self.named_buffers())
                if not getattr(t, "_is_hf_initialized", False) and not t.is_meta]
        if not todo:
            return
        with torch.device("cpu"):
            fresh = create_model(self.config.model_name, **self.config.init_kwargs).state_dict()
        for name, t in todo:
            t.copy_(fresh[name])


def _lm_hidden_states(net: nn.Module, input_ids: torch.Tensor, mask: Optional[torch.Tensor],
                      cu_seqlens: Optional[torch.Tensor] = None):
    """``(final hidden after ln_f, hidden_states)``: embeddings, then each block's output, the last
    one replaced by the final hidden (after ``ln_f``), as GPT-2 / Llama report them."""
    states: list = []
    final = net._run_blocks(input_ids, mask, cu_seqlens, states, idx_checked=True)  # input_ids checked at the door
    return final, tuple(states[:-1]) + (final,)


class _WhiteformerLMBase(WhiteformerPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.wte = value

    def resize_token_embeddings(self, new_num_tokens: Optional[int] = None, pad_to_multiple_of: Optional[int] = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """``transformers``' resize (the tied ``lm_head`` follows ``wte``), then the whiteformer model's
        ``vocab_size`` (its id check) and the configuration's ``init_kwargs`` (what a reload builds)
        take the new size."""
        emb = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        n = emb.weight.shape[0]
        net = self.whiteformer
        net.lm_head.out_features = n
        net.vocab_size = n
        if hasattr(net, "init_kwargs"):
            net.init_kwargs = {**net.init_kwargs, "vocab_size": n}
        self.config.init_kwargs = {**self.config.init_kwargs, "vocab_size": n}
        self.config.vocab_size = n
        return emb


class _WhiteformerLMModel(_WhiteformerLMBase):
    """Headless language model (``AutoModel``): ``forward(input_ids, attention_mask,
    output_hidden_states)`` -> ``BaseModelOutputWithPast(last_hidden_state (B, T, D) after ln_f,
    hidden_states)``; packed documents (``position_ids`` restarting at 0 / ``cu_seq_lens_q``) as the
    ``ForCausalLM`` class takes them; no cache (generation is the ``ForCausalLM`` class's)."""

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                use_cache: Optional[bool] = None, past_key_values: Optional[Cache] = None,
                inputs_embeds: Optional[torch.Tensor] = None, position_ids: Optional[torch.LongTensor] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, **kwargs) -> BaseModelOutputWithPast:
        _refuse(output_attentions, return_dict, inputs_embeds)
        _refuse_labels(self, kwargs, "AutoModelForCausalLM")
        output_hidden_states = _want_hidden_states(self, output_hidden_states)
        _check_input_ids(self.whiteformer, input_ids)
        if use_cache or (past_key_values is not None and past_key_values.get_seq_length() != 0):
            raise ValueError(f"{type(self).__name__} is headless and keeps no cache; generate with the "
                             "ForCausalLM class (AutoModelForCausalLM)")
        net, mask = self.whiteformer, attention_mask
        cu_seqlens = packed_cu_seqlens(attention_mask, position_ids, kwargs, input_ids)
        if cu_seqlens is not None:
            cu_seqlens, mask = cu_seqlens.to(input_ids.device), None
        if output_hidden_states:
            final, hidden = _lm_hidden_states(net, input_ids, mask, cu_seqlens)
        else:
            final, hidden = net._run_blocks(input_ids, mask, cu_seqlens, idx_checked=True), None
        return _output(BaseModelOutputWithPast, last_hidden_state=final, hidden_states=hidden)


class _WhiteformerForCausalLM(_WhiteformerLMBase, GenerationMixin):
    #: neither cache (ToST's running statistics, the GPT's WhiteformerCache) can be cropped back to
    #: the tokens a verifier accepted, so transformers refuses assisted decoding by any route
    _is_stateful = True
    #: inside ``generate()``: what it checked once (the prompt's ids; the prompt's mask, on the first
    #: ``prepare_inputs_for_generation``), so that no generated token reads a value again; else None
    _generation = None

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``; assisted (speculative) decoding is refused up front. The prompt's
        ids are checked here once; the forward of each generated token reads none of its inputs' values."""
        for key in ("assistant_model", "prompt_lookup_num_tokens"):
            if kwargs.get(key) is not None:
                raise ValueError(f"assisted decoding ({key}=...) is not supported by whiteformer models: their "
                                 "cache cannot be rolled back to the accepted tokens; generate without it")
        for key in ("cache", "past_key_values"):
            check_user_cache(kwargs.get(key))
        if kwargs.get("cache_implementation") == "paged":  # (transformers switches to continuous batching here)
            refuse_continuous_batching()
        prompt = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        if isinstance(prompt, torch.Tensor):
            _check_input_ids(self.whiteformer, prompt)  # the sampled tokens are in the vocabulary
        outer, self._generation = self._generation, {}
        try:
            return super().generate(*args, **kwargs)
        finally:
            self._generation = outer

    def _prepare_generation_config(self, generation_config, **kwargs):
        """``transformers``' resolved generation configuration (arguments > ``generation_config`` >
        the model's), with the cache options the model cannot honour refused (:mod:`.generation`)."""
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        check_generation_config(generation_config)
        return generation_config, model_kwargs

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False,
                                      input_ids: Optional[torch.LongTensor] = None, **model_kwargs):
        """``transformers``' expansion of the batch for ``num_beams`` / ``num_return_sequences``, plus the
        state of a prompt cache passed in (``past_key_values=``), which it leaves at the prompts' batch size:
        each row's state is repeated as its prompt is."""
        batch = None if input_ids is None else input_ids.shape[0]
        input_ids, model_kwargs = super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids,
                                                                        **model_kwargs)
        for key in ("cache", "past_key_values"):
            cache = model_kwargs.get(key)
            if expand_size > 1 and isinstance(cache, WhiteformerCache) and cache.is_initialized \
                    and cache.batch_size == batch:
                cache.batch_repeat_interleave(expand_size)
        return input_ids, model_kwargs

    def init_continuous_batching(self, *args, **kwargs):
        """Refused: continuous batching (``generate_batch``) needs a paged key/value cache."""
        refuse_continuous_batching()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward creates a WhiteformerCache

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        past_key_values: Optional[Cache] = None,
        use_cache: Optional[bool] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids (B, T); attention_mask (B, T) 1 = real token, 0 = padding (left or right);
        labels (B, T) next-token targets, shifted inside as ``transformers`` does (-100 ignored).

        With a non-empty cache, input_ids are the new tokens (their mask columns must be 1) and
        the model steps through them from the cached state. Positions come from
        ``attention_mask`` (real tokens counted; ``position_ids`` that ``generate`` derives the same
        way are accepted). Packed documents (``DataCollatorWithFlattening``): input_ids (1, T) with
        ``position_ids`` restarting at 0 at each document or ``cu_seq_lens_q`` become the model's
        ``cu_seqlens`` (each document its own sequence; labels never cross a document; no cache);
        other ``position_ids`` raise ``ValueError``. ``use_cache`` (default
        ``config.use_cache`` in eval mode, off in training) returns the state in
        ``output.cache`` (``past_key_values`` in older ``transformers``). ``output_hidden_states``
        (default ``config.output_hidden_states``) adds the embeddings and each block's output, also
        for tokens stepped from a cache (``generate(..., output_hidden_states=True)``). ``logits_to_keep``
        (as ``transformers``): 0 every position, k > 0 the last k, a 1-D tensor those positions;
        ``generate`` passes 1, so a prompt's (B, T, V) logits are never formed.
        """
        _refuse(output_attentions, return_dict, inputs_embeds)
        output_hidden_states = _want_hidden_states(self, output_hidden_states)
        generating = self._generation is not None  # generate() checked its prompt; it samples the rest
        _check_input_ids(self.whiteformer, input_ids, values=not generating)
        keep = logits_to_keep
        if labels is not None and not (is_int(keep) and keep == 0):
            raise ValueError("labels need the logits of every position: leave logits_to_keep at 0 with labels")
        if labels is not None:
            check_lm_labels(labels, input_ids, self.whiteformer.vocab_size, kwargs.get("ignore_index", -100))
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the cache once (cache or past_key_values), not both")
        cache = cache if cache is not None else past_key_values
        check_user_cache(cache)
        if cache is not None and not isinstance(cache, WhiteformerCache):
            if not isinstance(cache, Cache) or cache.get_seq_length() != 0:
                raise TypeError(f"cache must be a WhiteformerCache (from a previous forward), got "
                                f"{type(cache).__name__}")
            cache = None  # an empty transformers cache: start ours
        in_prompt = cache is None or cache.state is None
        cu_seqlens = packed_cu_seqlens(attention_mask, position_ids if in_prompt else None, kwargs, input_ids)
        if cu_seqlens is not None:
            return self._forward_packed(input_ids, attention_mask, labels, cu_seqlens, use_cache, cache, kwargs,
                                        bool(output_hidden_states), keep)
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        net = self.whiteformer
        hidden = None
        if cache is None or cache.state is None:
            if use_cache or cache is not None:
                # prefill without the lm_head
                final, state = net._prefill_hidden(input_ids, net._check_prompt_mask(input_ids, attention_mask))
                logits = net.lm_head(kept_positions(final, keep))
                cache = cache if cache is not None else WhiteformerCache()
                cache.update_state(state, input_ids.shape[1])
                if output_hidden_states:  # (prefill keeps only the final states: one more pass)
                    hidden = _lm_hidden_states(net, input_ids, attention_mask)[1]
            elif output_hidden_states:
                final, hidden = _lm_hidden_states(net, input_ids, attention_mask)
                logits = net.lm_head(kept_positions(final, keep))
            else:
                final = net._run_blocks(input_ids, attention_mask, None, idx_checked=True)
                logits = net.lm_head(kept_positions(final, keep))
        else:
            if cache.batch_size != input_ids.shape[0]:
                raise ValueError(f"the cache holds the state of {cache.batch_size} sequences, input_ids has "
                                 f"{input_ids.shape[0]} rows: pass the cache of this batch")
            new = input_ids.shape[1]
            if not generating and attention_mask is not None and not bool((attention_mask[:, -new:] != 0).all()):
                raise ValueError("tokens fed after the cached prompt must be real (attention_mask 1): padding is "
                                 "only supported in the prompt")
            state, finals, columns = cache.state, [], []
            for j in range(new):
                per_block = []  # (input_ids checked at the door)
                # (generate() crops the context itself: prepare_inputs_for_generation)
                final, state = net._step_hidden(input_ids[:, j], state if generating else net._check_state(state),
                                                per_block)
                finals.append(final)
                columns.append(per_block)
            final = torch.stack(finals, dim=1)
            logits = net.lm_head(kept_positions(final, keep))
            if output_hidden_states:  # (B, new, D) per entry; the last one after ln_f, as in _lm_hidden_states
                hidden = tuple(torch.stack(c, dim=1) for c in zip(*columns))[:-1] + (final,)
            cache.update_state(state, new)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=net.vocab_size, **kwargs)
        return _output(CausalLMOutputWithPast, loss=loss, logits=logits, cache=cache if use_cache else None,
                       hidden_states=hidden)


    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, *args, **kwargs):
        """``transformers``' inputs, cropped like :meth:`whiteformer.models.lm.CausalLM.generate`: once a
        sequence holds more real tokens than the model's context limit (``max_len`` of a learned
        position embedding or ToST's position bias), the state is rebuilt from the last
        ``max_len`` positions at every new token (as nanoGPT). A right-padded prompt (given, or the mask
        ``generate`` infers from ``pad_token_id``) is refused, and so is a prompt cache that already holds
        the whole prompt (``transformers`` would feed the prompt again on top of it)."""
        mask = kwargs.get("attention_mask")
        limit = self.whiteformer.context_limit
        generation = self._generation if self._generation is not None else {}
        prompt = generation.get("prompt")  # (prompt length, its most real tokens): read once per generate()
        if prompt is None:
            check_prompt_mask(mask)
            real = input_ids.shape[1] if mask is None or limit is None else int((mask != 0).sum(dim=-1).max())
            generation["prompt"] = prompt = (input_ids.shape[1], real)
        uncached = kwargs.get("next_sequence_length")  # a prompt cache passed in: the prompt's tokens it lacks
        if uncached is not None and uncached <= 0:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            raise ValueError(f"the cache passed in already holds {cache.get_seq_length()} positions of this "
                             f"{input_ids.shape[1]}-position prompt: at least its last token must be new (the "
                             "cache keeps no logits); pass the cache of a shorter prefix")
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        real = prompt[1] + input_ids.shape[1] - prompt[0]  # each generated token is real (its mask column 1)
        if limit is None or real <= limit:
            return inputs
        inputs["input_ids"] = input_ids[:, -limit:].clone()
        if mask is not None:
            inputs["attention_mask"] = mask[:, -limit:]
        inputs.pop("position_ids", None)
        cache = inputs.get("cache", inputs.get("past_key_values"))
        if isinstance(cache, WhiteformerCache):  # a fresh prefill of the window; positions consumed stay counted
            cache.state, cache.seq_length = None, input_ids.shape[1] - limit
        return inputs

    def _forward_packed(self, input_ids, attention_mask, labels, cu_seqlens, use_cache, cache, kwargs,
                        output_hidden_states=False, logits_to_keep=0):
        if use_cache or (cache is not None and cache.get_seq_length() != 0):
            raise ValueError("a packed batch (position_ids restarting / cu_seq_lens_q) runs without a cache: pass "
                             "use_cache=False and no past_key_values")
        net = self.whiteformer
        hidden = None
        if output_hidden_states:
            final, hidden = _lm_hidden_states(net, input_ids, None, cu_seqlens.to(input_ids.device))
        else:
            final = net._run_blocks(input_ids, None, cu_seqlens.to(input_ids.device), idx_checked=True)
        logits = net.lm_head(kept_positions(final, logits_to_keep))
        loss = None
        if labels is not None:
            labels = mask_document_starts(labels, cu_seqlens)
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=net.vocab_size, **kwargs)
        return _output(CausalLMOutputWithPast, loss=loss, logits=logits, cache=None, hidden_states=hidden)


class ToSTModel(_WhiteformerLMModel):
    """Headless causal ToST (``tost_lm_*``, ``AutoModel``)."""

    config_class = ToSTLMConfig
    family = "whiteformer-tost-lm"


class ToSTForCausalLM(_WhiteformerForCausalLM):
    """Causal ToST (``tost_lm_*``): generation carries the constant-size causal-TSSA statistics."""

    config_class = ToSTLMConfig
    family = "whiteformer-tost-lm"


class WhiteformerGPTModel(_WhiteformerLMModel):
    """Headless softmax GPT baseline (``gpt_*``, ``AutoModel``)."""

    config_class = WhiteformerGPTConfig
    family = "whiteformer-gpt"


class WhiteformerGPTForCausalLM(_WhiteformerForCausalLM):
    """Softmax GPT baseline (``gpt_*``): generation carries a key/value cache."""

    config_class = WhiteformerGPTConfig
    family = "whiteformer-gpt"


class WhiteformerDecoderModel(_WhiteformerLMModel):
    """Headless Llama-style decoder (``decoder_base``, ``tost_decoder_base``, ``AutoModel``)."""

    config_class = WhiteformerDecoderConfig
    family = "whiteformer-decoder"


class WhiteformerDecoderForCausalLM(_WhiteformerForCausalLM):
    """Llama-style decoder: generation carries a key/value cache for the softmax layers and the
    constant-size causal-TSSA statistics for the others."""

    config_class = WhiteformerDecoderConfig
    family = "whiteformer-decoder"


class _WhiteformerVisionBase(WhiteformerPreTrainedModel):
    config_class = WhiteformerVisionConfig
    family = "whiteformer-vision"
    main_input_name = "pixel_values"

    def _features(self, pixel_values, output_attentions, output_hidden_states, return_dict):
        """``(forward_features output, hidden_states or None)``."""
        _refuse(output_attentions, return_dict)
        output_hidden_states = _want_hidden_states(self, output_hidden_states)
        if pixel_values is None:
            raise ValueError("pixel_values is required: a (B, C, H, W) image tensor")
        if isinstance(pixel_values, torch.Tensor) and pixel_values.is_floating_point():
            pixel_values = pixel_values.to(self.dtype)  # as transformers' vision models (an fp16 checkpoint)
        net = self.whiteformer
        if output_hidden_states:
            final, states = net.forward_hidden_states(pixel_values)
            return final, tuple(states)
        return net.forward_features(pixel_values), None


class WhiteformerVisionModel(_WhiteformerVisionBase):
    """Headless vision model (``AutoModel``): ``forward(pixel_values)`` ->
    ``BaseModelOutputWithPooling(last_hidden_state = forward_features (B, 1 + N, D), pooler_output =
    the head's input (B, D), hidden_states)``."""

    def forward(self, pixel_values: Optional[torch.Tensor] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
                **kwargs) -> BaseModelOutputWithPooling:
        _refuse_labels(self, kwargs, "AutoModelForImageClassification")
        final, hidden = self._features(pixel_values, output_attentions, output_hidden_states, return_dict)
        pooled = self.whiteformer.forward_head(final, pre_logits=True)
        return BaseModelOutputWithPooling(last_hidden_state=final, pooler_output=pooled, hidden_states=hidden)


class WhiteformerForImageClassification(_WhiteformerVisionBase):
    """Vision zoo model: ``forward(pixel_values (B, C, H, W), labels=None)`` ->
    ``ImageClassifierOutput(loss, logits (B, num_classes), hidden_states)``; the loss follows
    ``config.problem_type`` as in ``transformers`` (integer labels: cross-entropy)."""

    def forward(self, pixel_values: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None, **kwargs) -> ImageClassifierOutput:
        final, hidden = self._features(pixel_values, output_attentions, output_hidden_states, return_dict)
        logits = self.whiteformer.forward_head(final)
        loss = None
        if labels is not None:
            labels = check_classification_labels(labels, logits, self.config)
            loss = self.loss_function(labels, logits, self.config, **kwargs)
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=hidden)


def _register() -> None:
    """The model classes with ``transformers``' Auto classes (once ``modeling_auto`` is loaded)."""
    from transformers.models.auto import modeling_auto as auto

    for config, base, head, auto_head in (
            (ToSTLMConfig, ToSTModel, ToSTForCausalLM, auto.AutoModelForCausalLM),
            (WhiteformerGPTConfig, WhiteformerGPTModel, WhiteformerGPTForCausalLM, auto.AutoModelForCausalLM),
            (WhiteformerDecoderConfig, WhiteformerDecoderModel, WhiteformerDecoderForCausalLM,
             auto.AutoModelForCausalLM),
            (WhiteformerVisionConfig, WhiteformerVisionModel, WhiteformerForImageClassification,
             auto.AutoModelForImageClassification)):
        auto.AutoModel.register(config, base, exist_ok=True)
        auto_head.register(config, head, exist_ok=True)
    # the class-name tables transformers reads besides the Auto classes: Trainer shifts the labels of
    # label smoothing only for the names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (else each position is
    # trained on its own token); pipelines check a model's task there
    for names, config, head in ((auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, ToSTLMConfig, ToSTForCausalLM),
                                (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, WhiteformerGPTConfig, WhiteformerGPTForCausalLM),
                                (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, WhiteformerDecoderConfig,
                                 WhiteformerDecoderForCausalLM),
                                (auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES, WhiteformerVisionConfig,
                                 WhiteformerForImageClassification)):
        names.setdefault(config.model_type, head.__name__)


when_imported("transformers.models.auto.modeling_auto", _register)
