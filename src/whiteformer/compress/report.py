"""The result of :func:`whiteformer.compress.compress`: :class:`CompressionReport` (IrrAtt paper,
Table 1's columns: per block the QK ranks and relative errors, for the model the FLOPs / parameter
ratios), as a dict (:meth:`~CompressionReport.to_dict`) or markdown (:meth:`~CompressionReport.to_markdown`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .._utils import to_jsonable
from .latency import latency_verdict

__all__ = ["CompressionReport"]

_METHOD_NAMES = {"truncatt": "TruncAtt", "cp": "CP SlimAtt", "irratt": "IrrAtt", "none": "MHSA (QK exact)",
                 "original": "MHSA"}


@dataclass
class CompressionReport:
    """What :func:`compress` did (IrrAtt paper, Table 1's columns).

    Attributes:
        config: the arguments of the call.
        blocks: one dict per block (see :meth:`to_dict`).
        num_tokens: N used for the per-block MACs formulas and the rank budget.
        params, params_orig: parameters of the whole model after / before.
        flops, flops_orig: FLOPs of one image through the whole model (flop counter).
        mhsa_flops, mhsa_flops_orig: FLOPs of the attention modules only (summed over blocks).
        latency: optional :func:`~.latency.compare_latency` result (``before_ms``/``after_ms`` medians,
            ``*_iqr_ms`` interquartile ranges, ``speedup`` or None when the ranges overlap, ...).
        extra: free-form results added by callers (e.g. fine-tuning accuracies).
    """

    config: dict
    blocks: List[dict]
    num_tokens: int
    params: int
    params_orig: int
    flops: int
    flops_orig: int
    mhsa_flops: int
    mhsa_flops_orig: int
    latency: Optional[dict] = None
    extra: dict = field(default_factory=dict)

    @property
    def params_ratio(self) -> float:
        return self.params / self.params_orig

    @property
    def flops_ratio(self) -> float:
        """Whole-model FLOPs CR (Table 1 "FLOPs CR")."""
        return self.flops / self.flops_orig

    @property
    def mhsa_flops_ratio(self) -> float:
        """Attention-only FLOPs CR (Table 1 "MHSA FLOPs CR")."""
        return self.mhsa_flops / self.mhsa_flops_orig

    @property
    def qk_macs_ratio(self) -> float:
        """Sum of the blocks' QK MACs over the original (formulas of :mod:`.flops`)."""
        return sum(b["qk_macs"] for b in self.blocks) / sum(b["qk_macs_orig"] for b in self.blocks)

    def to_dict(self) -> dict:
        """JSON-able dict: ``mhsa_flops_ratio``, ``flops_ratio``, ``params_ratio``, ``qk_macs_ratio``,
        the counts, ``num_tokens``, ``config``, ``latency``, ``extra`` and ``blocks``: per block
        ``index``, ``compressed``, ``method``, ``fusion``, ``qk_ranks`` (per head: truncatt r_h;
        irratt the rank of head h's BTD block; cp R for every head, which all share the R terms;
        F/H when QK is exact), ``qk_block_ranks`` (the layer's groups), ``qk_total_rank`` (sum over
        heads; R for cp), ``vo_ranks``, ``qk_rel_error``, ``vo_rel_error``,
        ``qk_macs``/``qk_macs_orig``/``qk_flops_ratio``,
        ``vo_macs``/``vo_macs_orig``, ``attn_flops``/``attn_flops_orig`` (flop counter),
        ``attn_params``/``attn_params_orig``, ``mlp_rank``, ``activation_aware``, ``details``."""
        return to_jsonable({
            "mhsa_flops_ratio": self.mhsa_flops_ratio, "flops_ratio": self.flops_ratio,
            "params_ratio": self.params_ratio, "qk_macs_ratio": self.qk_macs_ratio,
            "flops": self.flops, "flops_orig": self.flops_orig, "mhsa_flops": self.mhsa_flops,
            "mhsa_flops_orig": self.mhsa_flops_orig, "params": self.params, "params_orig": self.params_orig,
            "num_tokens": self.num_tokens, "config": self.config, "latency": self.latency, "extra": self.extra,
            "blocks": self.blocks,
        }, "report", tensors=True)

    def _summary_ranks(self) -> Tuple[str, str, str, str]:
        comp = [b for b in self.blocks if b["compressed"]] or self.blocks
        methods = sorted({b["method"] for b in comp})
        qk = []
        for b in comp:
            r = b["qk_ranks"]
            if b["method"] == "irratt":
                v = str(sum(b["qk_block_ranks"]))
            elif b["method"] == "cp":
                v = str(r[0])
            else:
                v = str(r[0]) if len(set(r)) == 1 else "irregular"
            if v not in qk:
                qk.append(v)
        vo = []
        for b in comp:
            r = b["vo_ranks"]
            v = str(r[0]) if len(set(r)) == 1 else "irregular"
            if v not in vo:
                vo.append(v)
        mlp = []
        for b in comp:
            v = "-" if b["mlp_rank"] is None else "/".join(str(x) for x in sorted(set(b["mlp_rank"])))
            if v not in mlp:
                mlp.append(v)
        name = ", ".join(_METHOD_NAMES.get(m, m) for m in methods)
        return name, "/".join(qk), "/".join(vo), "/".join(mlp)

    def to_markdown(self) -> str:
        """Markdown: a Table 1-style summary row, the counts, the latency and a per-block table."""
        name, qk, vo, mlp = self._summary_ranks()
        lines = ["## Attention compression report", "",
                 "| QK block | QK rank | VO rank | MLP rank | MHSA FLOPs CR, % | FLOPs CR, % | # param CR, % |",
                 "|---|---|---|---|---|---|---|",
                 f"| {name} | {qk} | {vo} | {mlp} | {100 * self.mhsa_flops_ratio:.1f} | "
                 f"{100 * self.flops_ratio:.1f} | {100 * self.params_ratio:.1f} |", "",
                 "QK rank: per head for TruncAtt; the total over heads for IrrAtt (sum of its block ranks) "
                 "and CP SlimAtt (its shared rank R). VO rank: per head.", "",
                 f"N = {self.num_tokens} tokens. FLOPs of one image counted with torch.utils.flop_counter on the "
                 "explicit attention path (softmax, GELU, norms not counted): "
                 f"{self.flops_orig / 1e9:.4g} G -> {self.flops / 1e9:.4g} G (attention "
                 f"{self.mhsa_flops_orig / 1e9:.4g} G -> {self.mhsa_flops / 1e9:.4g} G); parameters "
                 f"{self.params_orig / 1e6:.4g} M -> {self.params / 1e6:.4g} M; QK MACs CR "
                 f"{100 * self.qk_macs_ratio:.1f} %."]
        if self.latency:
            lat = self.latency
            lines += ["", latency_line(lat)]
        for k, v in self.extra.items():
            if isinstance(v, Mapping):
                items = ", ".join(f"{a} = {b:.4g}" if isinstance(b, float) else f"{a} = {b}" for a, b in v.items())
                lines += ["", f"{k}: {items}"]
        lines += ["", "| block | QK | QK ranks (per head) | VO ranks | QK MACs CR, % | QK rel. error | "
                      "VO rel. error | MLP rank |", "|---|---|---|---|---|---|---|---|"]
        for b in self.blocks:
            mlp_r = "-" if b["mlp_rank"] is None else ",".join(str(x) for x in b["mlp_rank"])
            lines.append(f"| {b['index']} | {_METHOD_NAMES.get(b['method'], b['method'])} | "
                         f"{','.join(str(r) for r in b['qk_ranks'])} | {','.join(str(r) for r in b['vo_ranks'])} | "
                         f"{100 * b['qk_flops_ratio']:.1f} | {_fmt_err(b['qk_rel_error'])} | "
                         f"{_fmt_err(b['vo_rel_error'])} | {mlp_r} |")
        return "\n".join(lines) + "\n"


def _fmt_err(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def latency_line(lat: dict) -> str:
    """The latency sentence of the report: both medians with their IQRs, then the verdict."""
    def ms(key: str) -> str:
        lo, hi = lat[f"{key}_iqr_ms"]
        return f"{lat[f'{key}_ms']:.2f} ms (IQR {lo:.2f}-{hi:.2f})"

    return (f"Latency (batch {lat['batch_size']}, {lat['device']}, {lat['threads']} threads, {lat['runs']} runs of "
            f"each interleaved after {lat['warmup']} warm-up): original {ms('before')}, compressed {ms('after')}; "
            f"{latency_verdict(lat)}.")
