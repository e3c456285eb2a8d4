"""White-box analysis tools: coding rates of the MCR² family (:mod:`.rates`) and the ECA
toy experiment (:mod:`.eca_toy`, run with ``python -m whiteformer.analysis.eca_toy --out DIR``)."""
from .rates import (
    coding_rate,
    compression_rate,
    logdet_f,
    rate_reduction,
    subspace_compression_rate,
    variational_compression_rate,
)

__all__ = [
    "coding_rate",
    "compression_rate",
    "logdet_f",
    "rate_reduction",
    "subspace_compression_rate",
    "variational_compression_rate",
]
