"""Whole-model attention compression of a ViT / DeiT (IrrAtt paper, Sec. 3.4 and Sec. 4, Table 1).

:func:`compress` replaces the MHSA of every block (``model.blocks[i].attn``, timm layout: ``qkv``,
``proj``, ``num_heads``) by a compressed layer (QK: TruncAtt, CP SlimAtt or IrrAtt; VO: TruncAtt)
and optionally the MLP linears by truncated SVDs, on a deep copy of the model, and returns a
:class:`~.report.CompressionReport` with Table 1's columns: per block the QK ranks and the relative errors,
for the model the MHSA FLOPs CR, the FLOPs CR and the parameter CR. FLOPs are counted by
``torch.utils.flop_counter`` on one real image of the model's size with the explicit attention path
(``fused_attn = False`` on MHSA and the compressed layers), so softmax, GELU and norms are not
counted, as in the paper. With ``qk_flops_ratio`` each block gets the largest rank whose QK MACs are
at most that fraction of the original (local compression, Sec. 3.4).

Compressed checkpoints: the new model records a JSON spec of its compressed blocks in
``init_kwargs["compression"]`` (:mod:`whiteformer.compress.surgery`), so ``save_pretrained`` keeps it
and ``create_model(name, checkpoint_path=dir)`` rebuilds the compressed blocks before loading the
weights.

:func:`~.constraints.apply_fusion_constraints` (re-exported here) is the rank-constrained fine-tuning of
Sec. 3.3 (Eq. 7): call it after each optimizer step to project every head-fusion matrix onto ``{S >= 0, S S^T = I}``.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .._checks import check_finite, check_instance, check_tensor, is_int
from .._utils import count_params, eval_mode, to_jsonable
from ..models import create_model, from_pretrained, from_transformers_vit, resolve_model_dir
from ..models.formats.vit_weights import HF_VIT_MODEL_TYPES, init_kwargs_from_config, is_hf_vit_config, model_name_for
from ..models.read import read_config
from .compress_block import BlockReport, _compress_attention
from .constraints import apply_fusion_constraints  # noqa: F401  (re-exported: whiteformer.compress.model)
from .flops import count_flops, mhsa_qk_macs, mhsa_vo_macs
from .latency import compare_latency, example_images
from .layers import CompressedAttention
from .mlp import compress_mlp
from .progress import BlockProgress
from .qk_vo import mhsa_spec
from .report import CompressionReport
from .spec import CompressSpec
from .surgery import layer_spec, mlp_spec, record_compression_spec

__all__ = ["compress", "CompressSpec", "CompressionReport", "apply_fusion_constraints", "collect_block_inputs",
           "model_flops"]

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CompressSpec)}


# ----------------------------------------------------------------------------- model structure
def _as_timm_vit(model):
    """A ``transformers`` ViT / DeiT (converted: :func:`whiteformer.models.from_transformers_vit`), a
    :mod:`whiteformer.hf` wrapper (its whiteformer model) or a saved model folder (whiteformer's or a
    transformers ViT / DeiT ``save_pretrained`` folder) as the timm-layout model compress() works on;
    anything else unchanged."""
    if isinstance(model, (str, os.PathLike)):
        config = read_config(resolve_model_dir(model)) or {}
        if is_hf_vit_config(config):
            name = model_name_for(init_kwargs_from_config(config))
            return create_model(name, checkpoint_path=model).eval()
        return from_pretrained(model).eval()
    inner = getattr(model, "whiteformer", None)
    if isinstance(inner, nn.Module):
        return inner
    if getattr(getattr(model, "config", None), "model_type", None) in HF_VIT_MODEL_TYPES:
        return from_transformers_vit(model)
    return model


def _blocks(model) -> nn.Module:
    blocks = getattr(model, "blocks", None)
    if not isinstance(model, nn.Module) or not isinstance(blocks, (nn.Sequential, nn.ModuleList)) \
            or len(blocks) == 0:
        raise ValueError(f"compress() needs a ViT/DeiT-style model with a non-empty `blocks` list of blocks whose "
                         f"`attn` is an MHSA with qkv/proj (timm layout); got {type(model).__name__}")
    return blocks


def _check_mhsa(model: nn.Module, i: int) -> None:
    attn = getattr(model.blocks[i], "attn", None)
    where = f"{type(model).__name__}.blocks[{i}].attn"
    if isinstance(attn, CompressedAttention):
        raise ValueError(f"{where} is already compressed ({type(attn).__name__}); compress() needs MHSA blocks "
                         "with qkv/proj (select other blocks with blocks=[...])")
    try:
        mhsa_spec(attn)
    except (TypeError, ValueError) as err:
        raise ValueError(f"compress() needs MHSA blocks with qkv/proj (timm layout: qkv Linear(F, 3F), proj "
                         f"Linear(F, F), num_heads); {where} is {type(attn).__name__}: {err}") from err
    if getattr(attn, "causal", False):
        raise ValueError(f"{where} is causal; compress() supports bidirectional (vision) attention only")


def _check_mlp(model: nn.Module, i: int) -> None:
    mlp = getattr(model.blocks[i], "mlp", None)
    if not isinstance(getattr(mlp, "fc1", None), nn.Linear) or not isinstance(getattr(mlp, "fc2", None), nn.Linear):
        raise ValueError(f"mlp_rank needs timm-style MLPs with fc1/fc2 nn.Linear layers; "
                         f"{type(model).__name__}.blocks[{i}].mlp is {type(mlp).__name__}")


def _select(blocks: Optional[Tuple[int, ...]], n: int) -> List[int]:
    """The sorted block indices of a spec's ``blocks`` (None: all) in a model of ``n`` blocks."""
    if blocks is None:
        return list(range(n))
    for b in blocks:
        if not is_int(b) or not -n <= b < n:
            raise ValueError(f"blocks must hold block indices in [-{n}, {n}), got {b!r}")
    return sorted({b % n for b in blocks})


# ----------------------------------------------------------------------------- measurements
@torch.no_grad()
def collect_block_inputs(model: nn.Module, images: torch.Tensor, indices: Optional[Sequence[int]] = None,
                         mlp: bool = False) -> Dict[int, Dict[str, torch.Tensor]]:
    """Run ``model(images)`` (eval mode) with forward hooks and return, per block index, the tokens
    entering its attention (``"attn"``, after ``norm1``) and, with ``mlp``, its MLP (``"mlp"``),
    each (B, N, F), detached."""
    blocks = _blocks(model)
    idx = list(range(len(blocks))) if indices is None else list(indices)
    out: Dict[int, Dict[str, torch.Tensor]] = {i: {} for i in idx}
    hooks = []

    def grab(i, key):
        def hook(_m, args, _out):
            out[i][key] = args[0].detach()
        return hook

    for i in idx:
        hooks.append(blocks[i].attn.register_forward_hook(grab(i, "attn")))
        if mlp:
            hooks.append(blocks[i].mlp.register_forward_hook(grab(i, "mlp")))
    try:
        with eval_mode(model):
            model(images)
    finally:
        for h in hooks:
            h.remove()
    missing = [i for i in idx if "attn" not in out[i]]
    if missing:
        raise ValueError(f"the forward pass did not call blocks {missing}'s attention")
    return out


def model_flops(model: nn.Module, x: torch.Tensor,
                inputs: Optional[Dict[int, Dict[str, torch.Tensor]]] = None) -> Tuple[int, List[int]]:
    """``(total FLOPs of model(x), [FLOPs of blocks[i].attn])`` counted by
    ``torch.utils.flop_counter`` on the explicit attention path (see :func:`~.flops.count_flops`);
    ``inputs``: :func:`collect_block_inputs` of every block on ``x``, when the caller has them."""
    blocks = _blocks(model)
    inputs = collect_block_inputs(model, x) if inputs is None else inputs
    with eval_mode(model):
        total = count_flops(model, x)
        attn = [count_flops(blocks[i].attn, inputs[i]["attn"]) for i in range(len(blocks))]
    return total, attn


def _per_head_qk(rep: BlockReport, heads: int) -> List[int]:
    if rep.method == "irratt":
        return list(rep.head_ranks if rep.head_ranks is not None else rep.qk_ranks)
    if rep.method == "cp":
        return [int(rep.qk_ranks[0])] * heads
    return list(rep.qk_ranks)


def _previous_entry(i: int, layer: CompressedAttention, N: int) -> dict:
    """Entry of a block compressed by an earlier call (errors and original sizes unknown)."""
    F, H, p = layer.dim, layer.num_heads, layer.head_dim
    spec = layer_spec(layer)
    method = {"truncatt": "truncatt", "irratt": "irratt", "cp_slimatt": "cp"}[spec["type"]]
    groups = list(spec.get("qk_ranks") or spec.get("ranks") or [spec.get("rank")])
    per_head = groups if method != "cp" else groups * H
    if method == "irratt" and len(per_head) != H:
        per_head = [None] * H
    qo, vo = mhsa_qk_macs(N, F, H, p), mhsa_vo_macs(N, F, H, p)
    return {"index": i, "compressed": True, "method": method, "fusion": spec.get("fusion"), "qk_ranks": per_head,
            "qk_block_ranks": groups, "qk_total_rank": groups[0] if method == "cp" else sum(groups),
            "vo_ranks": list(layer.vo_ranks), "qk_rel_error": None, "vo_rel_error": None,
            "qk_macs": layer.qk_macs(N), "qk_macs_orig": qo, "qk_flops_ratio": layer.qk_macs(N) / qo,
            "vo_macs": layer.vo_macs(N), "vo_macs_orig": vo, "attn_params": count_params(layer),
            "attn_params_orig": None, "activation_aware": None, "details": {"previously_compressed": True}}


def _block_entry(i: int, attn: nn.Module, rep: Optional[BlockReport], N: int) -> dict:
    if rep is None and isinstance(attn, CompressedAttention):
        return _previous_entry(i, attn, N)
    spec = mhsa_spec(attn)
    F, H, p = spec.dim, spec.num_heads, spec.head_dim
    qo, vo = mhsa_qk_macs(N, F, H, p), mhsa_vo_macs(N, F, H, p)
    n_orig = count_params(attn)
    if rep is None:
        return {"index": i, "compressed": False, "method": "original", "fusion": None, "qk_ranks": [p] * H,
                "qk_block_ranks": [p] * H, "qk_total_rank": p * H, "vo_ranks": [p] * H, "qk_rel_error": 0.0,
                "vo_rel_error": 0.0,
                "qk_macs": qo, "qk_macs_orig": qo, "qk_flops_ratio": 1.0, "vo_macs": vo, "vo_macs_orig": vo,
                "attn_params": n_orig, "attn_params_orig": n_orig, "activation_aware": False, "details": {}}
    return {"index": i, "compressed": True, "method": rep.method, "fusion": rep.fusion,
            "qk_ranks": _per_head_qk(rep, H), "qk_block_ranks": list(rep.qk_ranks),
            "qk_total_rank": rep.qk_total_rank, "vo_ranks": list(rep.vo_ranks),
            "qk_rel_error": rep.qk_rel_error, "vo_rel_error": rep.vo_rel_error, "qk_macs": rep.qk_macs,
            "qk_macs_orig": rep.qk_macs_orig, "qk_flops_ratio": rep.qk_flops_ratio, "vo_macs": rep.vo_macs,
            "vo_macs_orig": rep.vo_macs_orig, "attn_params": rep.params, "attn_params_orig": rep.params_orig,
            "activation_aware": rep.activation_aware, "details": rep.details}


# ----------------------------------------------------------------------------- compress
def _spec(spec: Optional[CompressSpec], **kwargs) -> CompressSpec:
    """``spec``, or the spec of ``compress()``'s keyword arguments (checked by its ``__post_init__``)."""
    if spec is None:
        return CompressSpec(**kwargs)
    check_instance(spec, "spec", CompressSpec, "a CompressSpec")
    given = sorted(k for k, v in kwargs.items() if v != _DEFAULTS[k])
    if given:
        raise ValueError(f"give the options either as spec= or as keyword arguments, not both (got spec and "
                         f"{', '.join(given)})")
    return spec


def _check_calib(calib, model: nn.Module) -> torch.Tensor:
    check_tensor(calib, "calib", 4)
    check_finite(calib, "calib")
    if calib.shape[0] == 0:
        raise ValueError(f"calib must be a non-empty batch of images (B, C, H, W), got shape {tuple(calib.shape)}")
    ref = next(model.parameters())
    return calib.detach().to(device=ref.device, dtype=ref.dtype)


def compress(model: Union[nn.Module, str, os.PathLike], qk: Optional[str] = "irratt", qk_rank: Union[int, Sequence[int], None] = None,
             qk_flops_ratio: Optional[float] = None, vo: Optional[str] = "truncatt",
             vo_rank: Union[int, Sequence[int], None] = None, mlp_rank: Union[int, Sequence[int], None] = None,
             calib: Optional[torch.Tensor] = None, *, fusion: str = "general", rank_allocation: str = "btd",
             protocol: str = "flops",
             blocks: Optional[Sequence[int]] = None, num_tokens: Optional[int] = None, seed: int = 0,
             cp_kwargs: Optional[dict] = None, btd_kwargs: Optional[dict] = None,
             latency_batch: Optional[int] = None, latency_runs: int = 10, latency_warmup: int = 2,
             latency_threads: Optional[int] = None,
             allow_growth: bool = False, progress: bool = True,
             spec: Optional[CompressSpec] = None) -> Tuple[nn.Module, CompressionReport]:
    """Compress the attention (and optionally the MLPs) of a ViT / DeiT; ``model`` is left untouched.

    Args:
        model: a model with ``blocks[i].attn`` timm-layout MHSA (``qkv``, ``proj``, ``num_heads``) and a
            ``patch_embed`` (e.g. ``create_model("deit_t_p16", ...)``), or a ``transformers``
            ``ViTForImageClassification`` / ``ViTModel`` / DeiT without distillation token (converted
            first, same logits), or a :mod:`whiteformer.hf` wrapper of one, or a saved folder of either
            kind (a path).
        qk: "irratt" (BTD-(L, L, 1), Sec. 3), "cp" (CP SlimAtt), "truncatt" (per-head SVD) or None
            (QK exact).
        qk_rank: truncatt: per-head rank (int or H ints); cp: R; irratt: total rank (int) or H per-head
            ranks. The same for every block.
        qk_flops_ratio: instead of ``qk_rank``: per block the largest rank with QK MACs <= ratio x the
            original's (Sec. 3.4).
        protocol: how methods are compared at a ``qk_flops_ratio``: "flops" (default, ours: each
            method its largest rank within the QK MACs budget) or "rank" (the paper's Table 1: all
            methods get TruncAtt's total rank H r at that ratio, e.g. IrrAtt 96 vs TruncAtt 6 x 16 on
            DeiT-S; IrrAtt's general fusion and CP's head expansion then cost extra MACs). With
            "rank" an int ``qk_rank`` is the total QK rank for every method. See
            :mod:`whiteformer.compress.budget`.
        vo: "truncatt" or None; vo_rank: VO TruncAtt rank (int or H ints); None keeps VO exact.
        mlp_rank: rank of the truncated-SVD MLP linears (int, or (rank_fc1, rank_fc2)); None: MLP kept.
        calib: a calibration batch of images (B, C, H, W): each block's attention (and MLP) inputs
            are collected with forward hooks and the decompositions become activation-aware.
        fusion, rank_allocation, seed, cp_kwargs, btd_kwargs: see :func:`compress_attention`.
        blocks: indices of the blocks to compress (default all).
        num_tokens: N for the rank budget and the MACs (default: the tokens the blocks see on an image
            of the model's size, i.e. its patches + prefix tokens).
        latency_batch: if given, measure the latency of the original and the compressed model on a
            random batch of that size, interleaved (:func:`~.latency.compare_latency`: ``latency_warmup``
            untimed runs of each, then ``latency_runs`` timed pairs, on ``latency_threads`` CPU threads,
            default the current count): medians and interquartile ranges, and the speed-up only when
            the ranges do not overlap.
        progress: show progress, one step per compressed block (block i/n, QK rank, QK relative
            error): a tqdm bar when stderr is a terminal, else one line per block on stderr.
        allow_growth: accept ranks that make a block's attention (QK + VO MACs at ``num_tokens``) or
            an MLP linear cost more than the original (e.g. a large CP rank, whose head expansion
            costs ``N H R``); by default such a compression raises ``ValueError`` naming the block.
        spec: a :class:`~.spec.CompressSpec` holding all the options above (but ``calib``) instead of
            the keyword arguments, which must then be left at their defaults.
    Returns:
        ``(new_model, CompressionReport)``; the new model records its compressed blocks and the
        options (``CompressSpec.to_dict()``, one entry per call under ``"options"``) in
        ``init_kwargs["compression"]`` (checkpoints load back with ``create_model``).
    Raises:
        ValueError: a model without MHSA blocks (qkv/proj), bad options, ranks out of range or a
        per-head rank list that does not match the number of heads (the message names the block);
        TypeError / ValueError for a bad ``calib``.
    """
    opts = _spec(spec, qk=qk, qk_rank=qk_rank, qk_flops_ratio=qk_flops_ratio, vo=vo, vo_rank=vo_rank,
                 mlp_rank=mlp_rank, fusion=fusion, rank_allocation=rank_allocation, protocol=protocol, blocks=blocks,
                 num_tokens=num_tokens, seed=seed, cp_kwargs=cp_kwargs, btd_kwargs=btd_kwargs,
                 latency_batch=latency_batch, latency_runs=latency_runs, latency_warmup=latency_warmup,
                 latency_threads=latency_threads, allow_growth=allow_growth, progress=progress)
    do_attn = opts.compresses_attention
    if not do_attn and opts.mlp_rank is None:
        raise ValueError("nothing to compress: give qk (with qk_rank or qk_flops_ratio), vo_rank or mlp_rank")
    model = _as_timm_vit(model)
    bl = _blocks(model)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError("compress() needs the model's weights, but they are on the meta device (no values); "
                         "load or materialise the model first (e.g. create_model(..., checkpoint_path=...))")
    idx = _select(opts.blocks, len(bl))
    for i in idx:
        if do_attn:
            _check_mhsa(model, i)
        if opts.mlp_rank is not None:
            _check_mlp(model, i)
    N = opts.num_tokens
    mlp_rank = opts.mlp_rank

    inputs: Dict[int, Dict[str, torch.Tensor]] = {}
    if calib is not None:
        inputs = collect_block_inputs(model, _check_calib(calib, model), idx, mlp=mlp_rank is not None)

    x = example_images(model, 1)
    inputs_x = collect_block_inputs(model, x)
    flops_orig, attn_orig = model_flops(model, x, inputs_x)
    if N is None:  # counted on the model, not re-stated from its patch and prefix-token counts
        N = inputs_x[idx[0]]["attn"].shape[1]

    new = copy.deepcopy(model)
    reports: Dict[int, BlockReport] = {}
    entries: Dict[int, dict] = {}
    seconds: Dict[int, float] = {}
    bar = BlockProgress(len(idx), enabled=opts.progress)
    for i in idx:
        blk = new.blocks[i]
        entry: dict = {}
        t0 = time.perf_counter()
        try:
            if do_attn:
                layer, rep = _compress_attention(  # options checked by the spec, the block by _check_mhsa
                    blk.attn, mhsa_spec(blk.attn), opts, N, inputs.get(i, {}).get("attn"))
                blk.attn = layer
                reports[i] = rep
                entry["attn"] = layer_spec(layer)
            if mlp_rank is not None:
                blk.mlp = compress_mlp(blk.mlp, mlp_rank, calib=inputs.get(i, {}).get("mlp"),
                                       allow_growth=opts.allow_growth)
                entry["mlp"] = mlp_spec(blk.mlp)
        except (TypeError, ValueError) as err:
            bar.close()
            raise type(err)(f"block {i}: {err}") from err
        entries[i] = entry
        seconds[i] = time.perf_counter() - t0
        rep = reports.get(i)
        bar.update(i, rep.method if rep else None, _per_head_qk(rep, blk.attn.num_heads) if rep else None,
                   rep.qk_total_rank if rep else None, rep.qk_rel_error if rep and rep.method != "none" else None,
                   seconds[i])
    bar.close()
    record_compression_spec(new, entries, opts.to_dict())

    flops_new, attn_new = model_flops(new, x)
    rows = []
    for i in range(len(bl)):
        row = _block_entry(i, model.blocks[i].attn, reports.get(i), N)
        row["attn_flops"], row["attn_flops_orig"] = attn_new[i], attn_orig[i]
        row["mlp_rank"] = None
        row["seconds"] = seconds.get(i)
        if "mlp" in entries.get(i, {}):
            row["mlp_rank"] = [entries[i]["mlp"]["fc1_rank"], entries[i]["mlp"]["fc2_rank"]]
            row["compressed"] = True
        rows.append(row)

    latency = None
    if opts.latency_batch is not None:
        xb = example_images(model, opts.latency_batch)
        latency = compare_latency(model, new, xb, runs=opts.latency_runs, warmup=opts.latency_warmup,
                                  threads=opts.latency_threads)

    config = {k: getattr(opts, k) for k in ("qk", "qk_rank", "qk_flops_ratio", "vo", "vo_rank", "mlp_rank")}
    config.update(calib=None if calib is None else list(calib.shape), fusion=opts.fusion,
                  rank_allocation=opts.rank_allocation, protocol=opts.protocol, blocks=idx, seed=opts.seed,
                  allow_growth=opts.allow_growth)
    report = CompressionReport(config=to_jsonable(config, tensors=True), blocks=rows, num_tokens=N,
                               params=count_params(new), params_orig=count_params(model), flops=flops_new,
                               flops_orig=flops_orig,
                               mhsa_flops=sum(attn_new), mhsa_flops_orig=sum(attn_orig), latency=latency)
    return new, report
