"""transformers' causal language models -> whiteformer's: the config fields each shell honours,
and the weights' keys.

Read without importing transformers: a model object gives its ``config.to_dict()`` and
``state_dict()``; a ``save_pretrained`` folder its ``config.json`` and weights (``model.safetensors``,
its sharded form ``model.safetensors.index.json``, or ``pytorch_model.bin`` read with
``torch.load(weights_only=True)``). No code of the folder runs (``trust_remote_code`` never).

- ``gpt2`` -> :class:`~whiteformer.models.lm.GPTLM` (``gpt_base`` with the source's sizes): Conv1D
  weights transposed, layer scale 1, ``mlp_act="gelu_tanh"`` for GPT-2's ``gelu_new``.
- ``llama``, ``qwen2``, ``mistral`` -> :class:`~whiteformer.models.decoder.DecoderLM`
  (``decoder_base`` with the source's sizes), softmax attention in every layer.
- ``vit``, ``deit`` (``ViTForImageClassification``, ``DeiTForImageClassification`` without
  distillation token) -> the timm-layout ``vit`` / ``deit_*`` (:mod:`whiteformer.models.formats.vit_weights`).

A field whose value the shell cannot reproduce is a ``ValueError`` naming the field and the
values it supports, raised before anything is built.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn

from .._checks import is_int
from ..models import create_model, from_transformers_vit
from ..models.formats.vit_weights import HF_VIT_MODEL_TYPES, init_kwargs_from_config, model_name_for
from ..models.read import read_json, read_state_dict

__all__ = ["from_transformers", "SUPPORTED_MODEL_TYPES"]

#: names of the weights files of a transformers folder, in the order they are looked for
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
#: model types that are close relatives of a supported one, and what the shell lacks for them
_NOT_HONOURED = {
    "qwen3": "Qwen3's per-head q/k RMSNorms (q_norm, k_norm)",
    "qwen3_moe": "Qwen3's per-head q/k RMSNorms and mixture-of-experts MLPs",
    "gemma": "Gemma's scaled embeddings and (1 + w) RMSNorm gains",
    "mixtral": "Mixtral's mixture-of-experts MLPs",
    "phi3": "Phi-3's fused qkv / gate-up projections and longrope",
}


def _fail(field: str, value: Any, supported: str) -> None:
    raise ValueError(f"config field {field}={value!r} cannot be honoured by the whiteformer shell; supported: "
                     f"{supported}")


def _require(cfg: Mapping[str, Any], field: str, allowed: Tuple[Any, ...], default: Any = None) -> Any:
    """``cfg[field]`` (``default`` when absent), which must be one of ``allowed``."""
    value = cfg.get(field, default)
    if value not in allowed:
        _fail(field, value, " or ".join(repr(a) for a in allowed))
    return value


def _common(cfg: Mapping[str, Any]) -> None:
    """What no shell honours: quantized weights, cross-attention, an encoder-decoder."""
    if cfg.get("quantization_config"):
        _fail("quantization_config", cfg["quantization_config"].get("quant_method", "..."),
              "none (dequantize the model first)")
    _require(cfg, "add_cross_attention", (False, None))
    _require(cfg, "is_encoder_decoder", (False, None))


# ---- GPT-2 ---------------------------------------------------------------------------------------
_GPT2_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _gpt2_kwargs(cfg: Mapping[str, Any]) -> Tuple[str, Dict[str, Any]]:
    act = cfg.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTS:
        _fail("activation_function", act, " or ".join(repr(a) for a in _GPT2_ACTS))
    _require(cfg, "layer_norm_epsilon", (1e-5,), 1e-5)
    _require(cfg, "scale_attn_weights", (True,), True)
    _require(cfg, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(cfg, "tie_word_embeddings", (True,), True)
    dim, hidden = int(cfg["n_embd"]), cfg.get("n_inner") or 4 * int(cfg["n_embd"])
    ratio = hidden / dim
    if int(dim * ratio) != hidden:
        _fail("n_inner", hidden, f"a width that n_embd * (n_inner / n_embd) gives back exactly (n_embd={dim})")
    return "gpt_base", dict(vocab_size=int(cfg["vocab_size"]), dim=dim, depth=int(cfg["n_layer"]),
                            num_heads=int(cfg["n_head"]), max_len=int(cfg["n_positions"]), pos_emb=True,
                            mlp_ratio=ratio, bias=True, dropout=0.0, init_values=1.0, mlp_act=_GPT2_ACTS[act])


def _gpt2_state(sd: Mapping[str, torch.Tensor], kwargs: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for key, val in sd.items():
        key = key[len("transformer."):] if key.startswith("transformer.") else key
        if key.endswith((".attn.bias", ".attn.masked_bias")) and val.dim() != 1:
            continue  # the causal-mask buffers of older transformers
        if key == "lm_head.weight":
            out[key] = val
            continue
        parts = key.split(".")
        if parts[0] == "h" and len(parts) == 5 and parts[3] in ("c_attn", "c_proj", "c_fc") and parts[4] == "weight":
            val = val.t().contiguous()  # Conv1D stores (in, out)
        key = key.replace(".attn.c_attn.", ".attn.qkv.").replace(".attn.c_proj.", ".attn.proj.")
        out[f"transformer.{key}"] = val
    ones = torch.ones(kwargs["dim"], dtype=out["transformer.wte.weight"].dtype, device=out["transformer.wte.weight"].device)
    for i in range(kwargs["depth"]):
        out[f"transformer.h.{i}.gamma1"] = ones.clone()
        out[f"transformer.h.{i}.gamma2"] = ones.clone()
    out.setdefault("lm_head.weight", out["transformer.wte.weight"])
    return out


# ---- Llama, Qwen2, Mistral -----------------------------------------------------------------------
def _rope(cfg: Mapping[str, Any]) -> Tuple[float, Optional[Dict[str, Any]]]:
    """``(rope_theta, rope_scaling)`` from transformers 5's ``rope_parameters`` or 4's ``rope_theta``
    / ``rope_scaling``."""
    from ..models.decoder.layers import ROPE_TYPES

    params = dict(cfg.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None)
    theta = cfg.get("rope_theta", 10000.0) if theta is None else theta
    scaling = dict(cfg.get("rope_scaling") or params)
    partial = scaling.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        _fail("partial_rotary_factor", partial, "1.0 (rotary embedding over the whole head)")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    supported = [k for k in ROPE_TYPES if k is not None]
    if kind not in supported:
        _fail("rope_scaling.rope_type", kind, " or ".join(repr(k) for k in supported))
    if kind == "llama3":
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if kind == "default":
        return float(theta), None
    return float(theta), {"rope_type": kind, **{k: scaling.get(k) for k in ROPE_TYPES[kind]}}


def _llama_kwargs(cfg: Mapping[str, Any]) -> Tuple[str, Dict[str, Any]]:
    kind = cfg["model_type"]
    _require(cfg, "hidden_act", ("silu",), "silu")
    max_len = cfg.get("max_position_embeddings")
    if kind == "qwen2":
        _require(cfg, "use_sliding_window", (False,), False)
        qkv_bias, proj_bias, mlp_bias = True, False, False
    else:
        qkv_bias = proj_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
    window = cfg.get("sliding_window")
    if kind == "mistral" and window is not None and (max_len is None or window < max_len):
        _fail("sliding_window", window, f"None, or at least max_position_embeddings ({max_len}), so that it never "
                                        "binds")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        _fail("layer_types", sorted(set(layer_types)), "'full_attention' in every layer")
    theta, scaling = _rope(cfg)
    heads = int(cfg["num_attention_heads"])
    return "decoder_base", dict(
        vocab_size=int(cfg["vocab_size"]), dim=int(cfg["hidden_size"]), depth=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        intermediate_size=int(cfg["intermediate_size"]), max_len=None if max_len is None else int(max_len),
        rope_theta=theta, rope_scaling=scaling, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, proj_bias=proj_bias,
        mlp_bias=mlp_bias, attention="softmax", dropout=0.0)


_LLAMA_KEYS = (("model.embed_tokens.", "transformer.wte."), ("model.norm.", "transformer.ln_f."),
               ("model.layers.", "transformer.h."))
_LLAMA_BLOCK = (("input_layernorm.", "ln_1."), ("post_attention_layernorm.", "ln_2."),
                ("self_attn.o_proj.", "attn.proj."), ("self_attn.", "attn."))


def _llama_state(sd: Mapping[str, torch.Tensor], kwargs: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for key, val in sd.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer of older transformers, recomputed from rope_theta
        for old, new in _LLAMA_KEYS:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        if key.startswith("transformer.h."):
            i, rest = key[len("transformer.h."):].split(".", 1)
            for old, new in _LLAMA_BLOCK:
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            key = f"transformer.h.{i}.{rest}"
        out[key] = val
    if kwargs["tie_embeddings"]:
        out.setdefault("lm_head.weight", out.get("transformer.wte.weight"))
    return out


#: model_type -> (config fields -> (model name, constructor arguments), state dict -> whiteformer keys)
_FAMILIES: Dict[str, Tuple[Callable, Callable]] = {
    "gpt2": (_gpt2_kwargs, _gpt2_state),
    "llama": (_llama_kwargs, _llama_state),
    "qwen2": (_llama_kwargs, _llama_state),
    "mistral": (_llama_kwargs, _llama_state),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES) + HF_VIT_MODEL_TYPES


def _family(cfg: Mapping[str, Any]) -> Tuple[Callable, Callable]:
    kind = cfg.get("model_type")
    if kind not in _FAMILIES:
        why = f" ({_NOT_HONOURED[kind]} are not in the shell)" if kind in _NOT_HONOURED else ""
        _fail("model_type", kind, f"{', '.join(repr(k) for k in SUPPORTED_MODEL_TYPES)}{why}")
    return _FAMILIES[kind]


def _eos_token_id(cfg: Mapping[str, Any], generation: Mapping[str, Any], vocab_size: int) -> Optional[int]:
    """The source's end-of-sequence id, where its ``generate`` stops: the generation config's, else
    the config's; the first of a list (whiteformer's ``generate`` stops at one id); None when there is
    none or it lies outside the vocabulary (a tiny model's config keeps the default of a large one)."""
    eos = generation.get("eos_token_id", cfg.get("eos_token_id"))
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if not is_int(eos) or not 0 <= eos < vocab_size:
        return None
    return int(eos)


# ---- reading -------------------------------------------------------------------------------------
def _read_folder(folder: Path) -> Tuple[Dict[str, Any], Callable[[], Dict[str, torch.Tensor]]]:
    """(config.json, a function reading the weights) of a transformers ``save_pretrained`` folder."""
    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json (a transformers save_pretrained folder expected)")
    cfg = read_json(config, dict)
    weights = next((folder / n for n in _WEIGHTS if (folder / n).is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"{str(folder)!r} has none of the weights files {list(_WEIGHTS)}")

    def read() -> Dict[str, torch.Tensor]:
        if not weights.name.endswith(".index.json"):
            return read_state_dict(weights)
        shards = read_json(weights, dict).get("weight_map")
        if not isinstance(shards, dict):
            raise ValueError(f"{str(weights)!r} has no weight_map object")
        out: Dict[str, torch.Tensor] = {}
        for shard in sorted(set(shards.values())):
            path = folder / str(shard)
            if path.parent != folder:
                raise ValueError(f"{str(weights)!r} names a shard outside the folder: {shard!r}")
            out.update(read_state_dict(path))
        return out

    return cfg, read


def _generation_config(model_or_folder: Any) -> Dict[str, Any]:
    """The source's generation config ({} when it has none): ``generation_config.json`` of a folder,
    ``model.generation_config`` of a model."""
    if isinstance(model_or_folder, (str, os.PathLike)):
        path = Path(model_or_folder).expanduser() / "generation_config.json"
        return read_json(path, dict) if path.is_file() else {}
    gen = getattr(model_or_folder, "generation_config", None)
    return gen.to_dict() if callable(getattr(gen, "to_dict", None)) else {}


def _source(model_or_folder: Any) -> Tuple[Dict[str, Any], Callable[[], Dict[str, torch.Tensor]], Optional[nn.Module]]:
    if isinstance(model_or_folder, (str, os.PathLike)):
        path = Path(model_or_folder).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{str(model_or_folder)!r} is not a folder (a transformers save_pretrained "
                                    "folder or model expected)")
        cfg, read = _read_folder(path)
        return cfg, read, None
    config = getattr(model_or_folder, "config", None)
    if not isinstance(model_or_folder, nn.Module) or not callable(getattr(config, "to_dict", None)):
        raise TypeError(f"model_or_folder must be a transformers model (GPT2LMHeadModel, LlamaForCausalLM, "
                        f"Qwen2ForCausalLM, MistralForCausalLM) or the path of its save_pretrained folder, got "
                        f"{type(model_or_folder).__name__}")
    cfg = json.loads(json.dumps(config.to_dict(), default=str))  # plain values, as config.json would hold
    return cfg, lambda: {k: v.detach().clone() for k, v in model_or_folder.state_dict().items()}, model_or_folder


def from_transformers(model_or_folder: Union[nn.Module, str, os.PathLike]) -> nn.Module:
    """The whiteformer model equal to a transformers causal language model (or ViT), softmax attention.

    Args:
        model_or_folder: a ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
            ``MistralForCausalLM``, ``ViTForImageClassification`` or ``DeiTForImageClassification``,
            or the folder its ``save_pretrained`` wrote (read without transformers and without running
            its code).

    Returns:
        ``gpt_base`` (:class:`~whiteformer.models.lm.GPTLM`) for GPT-2, ``decoder_base``
        (:class:`~whiteformer.models.decoder.DecoderLM`) for Llama, Qwen2 and Mistral, ``vit`` /
        ``deit_*`` (timm's layout) for ViT and DeiT, with the source's sizes
        and weights (copies), its dtype and device, in the source's train/eval mode (eval for a
        folder). Its logits equal the source's; ``save_pretrained`` / ``whiteformer.from_pretrained``
        round-trip it. A language model's ``eos_token_id`` (where ``generate`` stops) is the
        source's: its generation config's, else its config's (the first of a list; none when it lies
        outside the vocabulary).

    Raises:
        ValueError: naming the config field (``model_type``, ``sliding_window``, ``rope_scaling``,
            ``hidden_act``, ...) the shell cannot honour, and its supported values.
    """
    cfg, read, source = _source(model_or_folder)
    if cfg.get("model_type") in HF_VIT_MODEL_TYPES:
        if source is not None:
            return from_transformers_vit(source)
        name = model_name_for(init_kwargs_from_config(cfg))
        return create_model(name, checkpoint_path=Path(model_or_folder).expanduser()).eval()
    to_kwargs, to_state = _family(cfg)
    _common(cfg)
    name, kwargs = to_kwargs(cfg)
    kwargs["eos_token_id"] = _eos_token_id(cfg, _generation_config(model_or_folder), kwargs["vocab_size"])
    with torch.device("meta"):
        net = create_model(name, **kwargs)  # sizes checked, nothing allocated
    state = net.convert_state_dict(to_state(read(), kwargs))
    own = set(net.state_dict())
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unexpected:
        raise ValueError(f"the {cfg['model_type']} weights do not fit the whiteformer shell: missing "
                         f"{missing[:8]}, unexpected {unexpected[:8]} (a field of the config the shell does not read?)")
    net.load_state_dict(state, strict=True, assign=True)
    if getattr(net, "tie_embeddings", True):  # assign=True loaded the two names as two parameters
        net.transformer.wte.weight = net.lm_head.weight
    net.model_name = name
    return net.train(bool(source.training) if source is not None else False)
