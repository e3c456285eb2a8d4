"""Attention compression toolkit ("Vision Transformer with Irregular Attention", the IrrAtt paper).

* :func:`compress` (whole model; its options as a :class:`CompressSpec`) and its
  :class:`CompressionReport`; :func:`compress_attention`, :func:`compress_mlp`,
  :func:`compress_linear` for one block or layer (:class:`BlockReport`);
* per-head QK / VO forms of a timm-layout MHSA block: :func:`qk_factors`, :func:`vo_factors`,
  :func:`mhsa_spec` (:class:`MHSASpec`);
* decompositions (typed results with ``.to_tensor()``): :func:`truncatt` (per-head truncated SVD),
  :func:`cp` (CP-ALS + CPD-EPC), :func:`btd_ll1` (BTD-(L, L, 1), Algorithms 1-3), activation-aware
  through ``calib=`` (:class:`Whitening`); rank from a QK FLOPs budget (:func:`qk_rank_for_budget`);
* the compressed layers: :class:`TruncAtt`, :class:`CPSlimAtt`, :class:`IrrAtt` (+ VO TruncAtt in
  each; :mod:`.layers`, registered with the attention registry as "truncatt", "cp_slimatt",
  "irratt") and :class:`LowRankLinear` (:mod:`.lowrank`); their plain reference from the dense QK /
  VO tensors (:mod:`.reference`);
* the rank-constrained head fusion of Sec. 3.3 (:func:`apply_fusion_constraints`; its projections in
  :mod:`.constraints`), latency (:func:`measure_latency`, :func:`compare_latency`); model surgery
  (:mod:`.surgery`) describes the compressed blocks in the model's ``init_kwargs["compression"]``
  (:func:`compression_spec`) and rebuilds them when a saved model loads
  (:func:`apply_compression_spec`, registered with :func:`whiteformer.models.registry.register_structure`).

The MACs formulas and the flop counter stay in :mod:`.flops`, the spectral rank allocation in
:mod:`.truncatt`.

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
from .cp import CPResult, cp
from .mlp import compress_linear, compress_mlp
from .qk_vo import MHSASpec, mhsa_spec, qk_factors, vo_factors
from .spec import CompressSpec
from .truncatt import TruncAttResult, truncatt
from .whitening import Whitening
from .latency import compare_latency, measure_latency
from .constraints import apply_fusion_constraints
from .model import compress
from .report import CompressionReport

__all__ = [
    # entry points
    "compress", "CompressSpec", "compress_attention", "compress_mlp", "compress_linear", "qk_factors", "vo_factors",
    "mhsa_spec", "truncatt", "cp", "btd_ll1", "qk_rank_for_budget", "apply_fusion_constraints",
    "apply_compression_spec", "compression_spec", "measure_latency", "compare_latency",
    # layers
    "CompressedAttention", "TruncAtt", "CPSlimAtt", "IrrAtt", "LowRankLinear",
    # results and report
    "HeadFactors", "MHSASpec", "Whitening", "TruncAttResult", "CPResult", "BTDResult", "BlockReport",
    "CompressionReport",
]
