"""White-box analysis tools: coding rates of the MCR² family (:mod:`.rates`), layer-wise
capture of tokens and memberships (``with capture(model) as rec``), the layer-wise coding-rate
report and membership / class-token attention maps (``viz`` extra). The ECA toy experiment that
uses them is part of the application (``whiteformer analyze eca-toy``, :mod:`whiteformer.app.eca_toy`)."""
from .capture import BlockRecord, Recording, capture
from .maps import cls_attention_maps, membership_maps
from .report import LayerwiseReport, layerwise_report
from .rates import (
    coding_rate,
    compression_rate,
    logdet_f,
    rate_reduction,
    subspace_compression_rate,
    variational_compression_rate,
)

__all__ = [
    "BlockRecord",
    "LayerwiseReport",
    "Recording",
    "capture",
    "cls_attention_maps",
    "layerwise_report",
    "membership_maps",
    "coding_rate",
    "compression_rate",
    "logdet_f",
    "rate_reduction",
    "subspace_compression_rate",
    "variational_compression_rate",
]
