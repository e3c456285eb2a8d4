"""The white-box lens on any ``transformers`` model: layer-wise coding rates from its hidden states.

For a model that is not whiteformer's (a ``transformers`` ``PreTrainedModel``: ViT, GPT-2, BERT,
...), :func:`~whiteformer.analysis.report.layerwise_report` runs it once with
``output_hidden_states=True`` and measures, on each layer's tokens Z^l (one sample = one Z, tokens as
rows, (N, d); padded tokens left out when an ``attention_mask`` is given):

- ``R``: the coding rate R(Z^l) (ToST Eq. 1);
- ``R_c_U``: the compression term against a subspace split U_[K], R_c(Z^l | U_[K]) =
  sum_k R(Z^l U_k) (CRATE / ECA Eq. 2) -- by default the model's attention heads' split of the
  width (K = ``num_attention_heads`` blocks of d / K coordinates), or the ``subspaces`` given (an
  int K, or bases (K, d, p));
- ``delta_R_U``: R - R_c_U, the rate reduction against that split (CRATE's objective).

Z^l is the output of layer l (l = 1..L) with ``features="output"``, and its input with
``features="input"``: ``hidden_states[l]`` and ``hidden_states[l - 1]`` as ``transformers`` reports
them, except where the model reports its last state after the final norm (GPT-2, Llama: their
``hidden_states[-1]`` is ``ln_f`` of the last layer's output). Then layer L's own output is read
from that layer (a forward hook on the last module of the model's list of L layers), and the
normalised state is one more row, named "final norm" (``layer`` None), whose input is layer L's
output. The model has no memberships Pi, so R_c, delta_R and the variational columns are None.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from .._checks import is_int
from .._files import check_path
from .._progress import progress_bar
from . import rates

__all__ = ["is_transformers_model", "load_for_analysis", "split_bases", "hidden_state_rows", "example_inputs",
           "FINAL_NORM"]

#: the name of the row of a final normalised hidden state
FINAL_NORM = "final norm"


def is_transformers_model(model: Any) -> bool:
    """A ``transformers`` model (has a ``config`` with a ``model_type`` and a ``main_input_name``)."""
    config = getattr(model, "config", None)
    return isinstance(model, nn.Module) and isinstance(getattr(config, "model_type", None), str) \
        and isinstance(getattr(model, "main_input_name", None), str)


def load_for_analysis(path: Union[str, os.PathLike]) -> nn.Module:
    """A saved model folder as a module to analyse: whiteformer's own format (its ``config.json``
    names a ``model_name``) through :func:`whiteformer.from_pretrained`, any other ``transformers``
    folder through ``AutoModel.from_pretrained`` (headless: hidden states)."""
    from ..models import from_pretrained
    from ..models.read import read_config

    p = Path(check_path(path, "path"))
    if not p.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist (expected a save_pretrained directory)")
    config = read_config(p) or {}
    if config.get("model_name"):
        return from_pretrained(p)
    try:
        from transformers import AutoModel
    except ImportError as err:
        raise ImportError(f"{str(path)!r} is a transformers model folder: pip install whiteformer[hf]") from err
    return AutoModel.from_pretrained(str(p))


def split_bases(subspaces: Any, dim: int, default_heads: Optional[int]) -> Tuple[torch.Tensor, int]:
    """The subspace split U_[K] as ``(U (d, K*p), K)``: ``None`` -> ``default_heads`` coordinate
    blocks, an int K -> K coordinate blocks of d / K (d divisible by K), a tensor (K, d, p) -> those
    bases."""
    if isinstance(subspaces, torch.Tensor):
        if subspaces.dim() != 3 or subspaces.shape[1] != dim:
            raise ValueError(f"subspaces must be bases of shape (K, {dim}, p), got {tuple(subspaces.shape)}")
        k, _, p = subspaces.shape
        return subspaces.permute(1, 0, 2).reshape(dim, k * p), int(k)
    k = default_heads if subspaces is None else subspaces
    if not is_int(k) or k < 1 or dim % k:  # None: the model's config names no head count
        raise ValueError(f"subspaces must be an int K >= 1 dividing the width {dim}, or bases (K, {dim}, p); got {k!r}")
    return torch.eye(dim), k


def _heads(config) -> Optional[int]:
    for key in ("num_attention_heads", "n_head", "num_heads"):
        v = getattr(config, key, None)
        if is_int(v) and v > 0:
            return v
    return None


def _last_layer(model: nn.Module) -> Optional[nn.Module]:
    """The last module of the model's list of ``config.num_hidden_layers`` layers (GPT-2's ``h``,
    Llama's ``layers``, ``encoder.layer`` ...), or None when it has no such list."""
    num_layers = getattr(model.config, "num_hidden_layers", None)
    if not is_int(num_layers) or num_layers < 1:
        return None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) == num_layers:
            return m[-1]
    return None


def _layer_states(model: nn.Module, kwargs: Dict[str, Any]
                  ) -> Tuple[List[torch.Tensor], List[torch.Tensor], Optional[torch.Tensor]]:
    """One call of the model -> (inputs of layers 1..L, outputs of layers 1..L, the final normalised
    state or None when ``hidden_states[-1]`` is the last layer's own output)."""
    seen: Dict[str, Any] = {}
    last = _last_layer(model)
    handle = None
    if last is not None:
        handle = last.register_forward_hook(lambda m, args, out: seen.__setitem__("out", out))
    try:
        states = getattr(model(**kwargs), "hidden_states", None)
    finally:
        if handle is not None:
            handle.remove()
    if not states or len(states) < 2:
        raise ValueError(f"{type(model).__name__} returned no hidden_states for output_hidden_states=True")
    states = list(states)
    own = seen.get("out")
    own = own[0] if isinstance(own, (tuple, list)) and own else own
    final = None
    if isinstance(own, torch.Tensor) and own.shape == states[-1].shape and not torch.equal(own, states[-1]):
        final, states[-1] = states[-1], own  # hidden_states[-1] is the final norm of the last layer's output
    return states[:-1], states[1:], final


def _row(name: str, layer: Optional[int], kind: str, z_all: torch.Tensor, keep: Optional[torch.Tensor], eps: float,
         dtype: torch.dtype, U: torch.Tensor, k: int) -> Dict[str, Any]:
    samples = [z_all[b][keep[b]] for b in range(z_all.shape[0])] if keep is not None else [z_all]
    R, Rc = [], []
    for z in samples:
        z = z.to(dtype)
        R.append(rates.coding_rate(z, eps, dtype=dtype).reshape(-1))
        Rc.append(rates.subspace_compression_rate(z, U.to(z.device, dtype), eps, num_heads=k, dtype=dtype).reshape(-1))
    R, Rc = torch.cat(R), torch.cat(Rc)
    tokens = z_all.shape[-2] if keep is None else round(float(keep.sum(1).float().mean()))  # (mean real tokens)
    return {"layer": layer, "name": name, "attn": kind, "tokens": tokens, "dim": z_all.shape[-1], "heads": k,
            "R": float(R.mean()), "R_c": None, "delta_R": None, "R_c_var": None, "delta_R_var": None,
            "R_c_U": float(Rc.mean()), "delta_R_U": float((R - Rc).mean())}


def hidden_state_rows(model: nn.Module, inputs: torch.Tensor, eps: float, features: str, dtype: torch.dtype,
                      subspaces: Any = None, attention_mask: Optional[torch.Tensor] = None,
                      progress: bool = False) -> List[Dict[str, Any]]:
    """One row per layer (keys of :data:`whiteformer.analysis.report.COLUMNS`), and one for the final
    norm where the model reports it, from the model's hidden states (see the module docstring);
    ``progress``: a bar over the rows on a terminal."""
    kwargs = {model.main_input_name: inputs, "output_hidden_states": True}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    layer_in, layer_out, final = _layer_states(model, kwargs)
    dim = layer_in[0].shape[-1]
    U, k = split_bases(subspaces, dim, _heads(model.config))
    keep = None
    if attention_mask is not None:
        if attention_mask.shape != layer_in[0].shape[:2]:
            raise ValueError(f"attention_mask must have shape {tuple(layer_in[0].shape[:2])} (B, T), got "
                             f"{tuple(attention_mask.shape)}")
        keep = attention_mask.bool()
    kind = model.config.model_type
    zs = layer_out if features == "output" else layer_in
    rows = []
    with progress_bar(len(zs) + (final is not None), "layerwise", "layer", enabled=progress) as bar:
        for i, z in enumerate(zs, start=1):
            rows.append(_row(f"layer {i}", i, kind, z, keep, eps, dtype, U, k))
            bar.update(1)
        if final is not None:
            rows.append(_row(FINAL_NORM, None, kind, final if features == "output" else layer_out[-1], keep, eps,
                             dtype, U, k))
            bar.update(1)
    return rows


def example_inputs(model: nn.Module, samples: int = 8, seq_len: int = 32, seed: int = 0) -> torch.Tensor:
    """Random inputs of the right kind for ``model`` (when no data is given): standard-normal images
    (samples, C, H, W) of its configured size for a vision model, uniform token ids (samples, seq_len)
    below its vocabulary size for a text model. Rates measured on them describe the model's maps of
    noise, not of data."""
    g = torch.Generator().manual_seed(seed)
    config = getattr(model, "config", None)
    patch = getattr(model, "patch_embed", None)
    if patch is not None:  # a whiteformer vision model
        return torch.randn(samples, patch.in_chans, *patch.img_size, generator=g)
    if config is not None and getattr(model, "main_input_name", None) == "pixel_values":
        size = getattr(config, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return torch.randn(samples, getattr(config, "num_channels", 3), h, w, generator=g)
    vocab = getattr(config, "vocab_size", None) or getattr(model, "vocab_size", None)
    if not is_int(vocab) or vocab < 1:
        raise ValueError(f"cannot make example inputs for {type(model).__name__}: give them (options.inputs=FILE.pt)")
    limit = getattr(config, "max_position_embeddings", None) or getattr(model, "max_len", None) or seq_len
    return torch.randint(0, vocab, (samples, min(seq_len, int(limit))), generator=g)
