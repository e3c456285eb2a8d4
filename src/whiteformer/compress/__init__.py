"""Attention compression toolkit ("Vision Transformer with Irregular Attention", the IrrAtt paper).

* per-head QK / VO forms of a timm-layout MHSA block: :func:`qk_factors`, :func:`vo_factors`;
* decompositions (typed results with ``.to_tensor()``): :func:`truncatt` (per-head truncated SVD),
  :func:`cp` (CP-ALS + CPD-EPC), :func:`btd_ll1` (BTD-(L, L, 1), Algorithms 1-3), activation-aware
  through ``calib=`` (:class:`Whitening`);
* the compressed layers that :func:`compress_attention`, :func:`compress_mlp`, :func:`compress_linear`
  fill: :class:`TruncAtt`, :class:`CPSlimAtt`, :class:`IrrAtt` (+ VO TruncAtt in each; :mod:`.layers`,
  registered with the attention registry as "truncatt", "cp_slimatt", "irratt") and
  :class:`LowRankLinear` (:mod:`.lowrank`); their plain reference from the dense QK / VO tensors
  (:mod:`.reference`);
* MACs formulas and the flop counter (:mod:`.flops`), rank from a QK FLOPs budget
  (:func:`qk_rank_for_budget`), rank-constrained head fusion (:mod:`.constraints`);
* :func:`compress` (whole model) and its report; model surgery (:mod:`.surgery`) describes the
  compressed blocks in the model's ``init_kwargs["compression"]`` and rebuilds them when a saved model
  loads (registered with :func:`whiteformer.models.registry.register_structure`).

Layering: compress sits above ops, attention, layers and models, which never import it; importing
``whiteformer`` imports it, so its layers and its surgery are registered whatever is imported first.
"""
from .layers import CompressedAttention, CPSlimAtt, IrrAtt, TruncAtt
from .lowrank import LowRankLinear
from .surgery import apply_compression_spec, compression_spec
from ._tensor import HeadFactors
from .compress_block import BlockReport, compress_attention
from .btd import BTDResult, btd_ll1
from .budget import qk_rank_for_budget
from .constraints import fusion_head_ranks, fusion_penalty, project_fusion
from .cp import CPResult, cp
from .flops import (count_flops, cp_qk_macs, irratt_qk_macs, linear_macs, lowrank_linear_macs, mhsa_macs,
                    mhsa_qk_macs, mhsa_vo_macs, truncatt_qk_macs, vo_truncatt_macs)
from .mlp import compress_linear, compress_mlp
from .qk_vo import MHSASpec, mhsa_spec, qk_factors, vo_factors
from .truncatt import TruncAttResult, allocate_ranks_spectral, head_spectra, truncatt
from .whitening import Whitening

__all__ = [
    "HeadFactors", "BlockReport", "compress_attention", "BTDResult", "btd_ll1", "qk_rank_for_budget",
    "fusion_head_ranks", "fusion_penalty", "project_fusion", "CPResult", "cp", "count_flops", "cp_qk_macs",
    "irratt_qk_macs", "linear_macs", "lowrank_linear_macs", "mhsa_macs", "mhsa_qk_macs", "mhsa_vo_macs",
    "truncatt_qk_macs", "vo_truncatt_macs", "CompressedAttention", "CPSlimAtt", "IrrAtt", "LowRankLinear",
    "TruncAtt", "compress_linear", "compress_mlp", "MHSASpec", "mhsa_spec", "qk_factors", "vo_factors",
    "TruncAttResult", "allocate_ranks_spectral", "head_spectra", "truncatt", "Whitening",
]

# --- model-level compression (compress(), report, Sec. 3.3 constraints, latency) ---
from .latency import compare_latency, measure_latency  # noqa: E402
from .constraints import apply_fusion_constraints  # noqa: E402
from .model import compress  # noqa: E402
from .spec import CompressSpec  # noqa: E402
from .report import CompressionReport  # noqa: E402

__all__ += ["compress", "CompressSpec", "CompressionReport", "apply_fusion_constraints", "apply_compression_spec",
            "compression_spec", "measure_latency", "compare_latency"]
