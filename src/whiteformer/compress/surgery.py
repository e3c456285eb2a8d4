"""Model surgery for compressed checkpoints: describe the compressed blocks of a model as a small
JSON spec and rebuild them (IrrAtt paper layers) on a fresh model before its weights are loaded.

Each replaced layer is described by :func:`layer_spec` (layer type + sizes + ranks) and rebuilt
empty by :func:`_build_attention_layer`; a compressed MLP by :func:`mlp_spec` (the two ranks). A
model's ``init_kwargs["compression"]`` holds ``{"format": 1, "blocks": [{"attn": spec, "mlp": spec}
or None, ...], "options": [...]}`` (:func:`record_compression_spec`; ``"options"``: the
:class:`~.spec.CompressSpec` of each ``compress()`` call as a dict, read by no loader), so ``save_pretrained`` records it and
``create_model(name, checkpoint_path=dir)`` rebuilds the compressed blocks
(:func:`apply_compression_spec`, registered as the models' "compression" structure, which the model
constructor applies). The decompositions that fill the layers with values live in the rest of
:mod:`whiteformer.compress`.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Dict, List, Optional

import torch.nn as nn

from .._checks import check_instance
from ..models.registry import register_structure
from .layers import CompressedAttention, CPSlimAtt, IrrAtt, TruncAtt
from .lowrank import LowRankLinear

__all__ = ["SPEC_FORMAT", "layer_spec", "mlp_spec", "compression_spec",
           "apply_compression_spec", "record_compression_spec"]

SPEC_FORMAT = 1


def layer_spec(layer: nn.Module) -> dict:
    """JSON description (type + sizes + ranks) of a compressed attention layer, enough to rebuild an
    empty layer of the same shapes with :func:`_build_attention_layer`."""
    if isinstance(layer, TruncAtt):
        qk = {"type": "truncatt", "qk_ranks": list(layer.qk_ranks)}
    elif isinstance(layer, IrrAtt):
        qk = {"type": "irratt", "ranks": list(layer.block_ranks),
              "fusion": "identity" if layer.fusion is None else "general"}
    elif isinstance(layer, CPSlimAtt):
        qk = {"type": "cp_slimatt", "rank": int(layer.rank)}
    else:
        raise TypeError(f"layer_spec needs a compressed attention layer, got {type(layer).__name__}")
    return {**qk, "dim": layer.dim, "num_heads": layer.num_heads, "vo_ranks": list(layer.vo_ranks),
            "proj_bias": layer.proj.bias is not None, "attn_drop": float(layer.attn_drop.p),
            "proj_drop": float(layer.proj_drop.p), "qk_bias": layer.q.bias is not None}


def _build_attention_layer(spec: Mapping) -> CompressedAttention:
    """A fresh (untrained) compressed attention layer from :func:`layer_spec`'s description (a
    dict, checked by :func:`apply_compression_spec`)."""
    kind = spec.get("type")
    try:
        kw = dict(vo_ranks=list(spec["vo_ranks"]), qk_bias=bool(spec["qk_bias"]), proj_bias=bool(spec["proj_bias"]),
                  attn_drop=float(spec.get("attn_drop", 0.0)), proj_drop=float(spec.get("proj_drop", 0.0)))
        dim, heads = int(spec["dim"]), int(spec["num_heads"])
        if kind == "truncatt":
            return TruncAtt(dim, heads, qk_ranks=list(spec["qk_ranks"]), **kw)
        if kind == "irratt":
            return IrrAtt(dim, heads, ranks=list(spec["ranks"]), fusion=spec["fusion"], **kw)
        if kind == "cp_slimatt":
            return CPSlimAtt(dim, heads, rank=int(spec["rank"]), **kw)
    except KeyError as err:
        raise ValueError(f"attention spec of type {kind!r} misses the entry {err}") from None
    raise ValueError(f"unknown attention spec type {kind!r}; expected 'truncatt', 'irratt' or 'cp_slimatt'")


def mlp_spec(mlp: nn.Module) -> dict:
    return {"fc1_rank": int(mlp.fc1.rank), "fc2_rank": int(mlp.fc2.rank),
            "fc1_bias": mlp.fc1.second.bias is not None, "fc2_bias": mlp.fc2.second.bias is not None}


def compression_spec(model: nn.Module) -> Optional[dict]:
    """The compression spec recorded on ``model`` (None for an uncompressed model)."""
    spec = (getattr(model, "init_kwargs", None) or {}).get("compression")
    return spec if spec is not None else getattr(model, "compression", None)


def _replace_linear(mlp: nn.Module, name: str, rank: int, bias: bool) -> None:
    fc = check_instance(getattr(mlp, name), f"mlp.{name}", nn.Linear, "an nn.Linear to replace", error=ValueError)
    new = LowRankLinear(fc.in_features, fc.out_features, int(rank), bias=bool(bias))
    setattr(mlp, name, new.to(device=fc.weight.device, dtype=fc.weight.dtype))


def apply_compression_spec(model: nn.Module, spec: Mapping) -> nn.Module:
    """Replace the blocks described by ``spec`` (``{"format": 1, "blocks": [entry or None, ...]}``,
    entry ``{"attn": layer spec, "mlp": {"fc1_rank", "fc2_rank", ...}}``) by fresh compressed layers
    of the recorded shapes, in place (weights are loaded afterwards). Returns ``model``."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("blocks"), (list, tuple)):
        raise ValueError("compression must be a dict {'format': 1, 'blocks': [per-block entry or None, ...]}, got "
                         f"{spec!r:.200}")
    if spec.get("format", SPEC_FORMAT) != SPEC_FORMAT:
        raise ValueError(f"unsupported compression spec format {spec.get('format')!r} (expected {SPEC_FORMAT})")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        raise ValueError(f"a compression spec needs a model with a `blocks` list, got {type(model).__name__}")
    if len(spec["blocks"]) != len(blocks):
        raise ValueError(f"compression spec has {len(spec['blocks'])} block entries, the model has "
                         f"{len(blocks)} blocks")
    for i, entry in enumerate(spec["blocks"]):
        if entry is None:
            continue
        if not isinstance(entry, Mapping) or set(entry) - {"attn", "mlp"} \
                or not all(v is None or isinstance(v, Mapping) for v in entry.values()):
            raise ValueError(f"compression spec entry of block {i} must be a dict with keys 'attn' and/or 'mlp', "
                             f"each a dict or None, got {entry!r:.200}")
        blk = blocks[i]
        if entry.get("attn") is not None:
            old = blk.attn
            a = entry["attn"]
            ref = next(old.parameters())
            dim = getattr(getattr(old, "qkv", None), "in_features", getattr(old, "dim", None))
            if (a.get("dim"), a.get("num_heads")) != (dim, getattr(old, "num_heads", None)):
                raise ValueError(f"compression spec of block {i}: attention (dim {a.get('dim')}, heads "
                                 f"{a.get('num_heads')}) does not fit the model's (dim {dim}, heads "
                                 f"{getattr(old, 'num_heads', None)})")
            blk.attn = _build_attention_layer(a).to(device=ref.device, dtype=ref.dtype)
        if entry.get("mlp") is not None:
            m = entry["mlp"]
            try:
                _replace_linear(blk.mlp, "fc1", m["fc1_rank"], m.get("fc1_bias", True))
                _replace_linear(blk.mlp, "fc2", m["fc2_rank"], m.get("fc2_bias", True))
            except KeyError as err:
                raise ValueError(f"compression spec of block {i}: mlp entry misses {err}") from None
    return model


def record_compression_spec(model: nn.Module, entries: Dict[int, dict], options: Optional[dict] = None) -> None:
    """Record the compressed blocks ``entries`` (block index -> ``{"attn": ..., "mlp": ...}``) on
    ``model``, merged into a spec an earlier call recorded; ``options``: the call's
    ``CompressSpec.to_dict()``, appended to the spec's ``"options"`` list."""
    depth = len(model.blocks)
    old = compression_spec(model)
    blocks: List[Optional[dict]] = [None] * depth
    if old is not None and len(old.get("blocks", [])) == depth:
        blocks = [None if e is None else dict(e) for e in old["blocks"]]
    for i, e in entries.items():
        blocks[i] = {**(blocks[i] or {}), **e}
    spec = {"format": SPEC_FORMAT, "blocks": blocks}
    calls = list((old or {}).get("options") or []) + ([options] if options is not None else [])
    if calls:
        spec["options"] = calls
    kwargs = getattr(model, "init_kwargs", None)  # every constructor argument, defaults included
    if isinstance(kwargs, dict) and "compression" in kwargs:
        kwargs["compression"] = spec
    else:
        model.compression = spec
        warnings.warn(f"{type(model).__name__} has no `compression` constructor argument: the compressed model "
                      "works but its save_pretrained checkpoint will not rebuild the compressed blocks",
                      stacklevel=3)


register_structure("compression", apply_compression_spec)
