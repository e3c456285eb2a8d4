"""Metrics log of a run: one JSON object per line in ``metrics.jsonl`` (written as training goes,
flushed each record), ``metrics.csv`` (written at the end) and TensorBoard scalars when the
``tensorboard`` package is installed. Records carry ``step`` and either training (``train_*``)
or evaluation (``eval_*``) values."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..._checks import is_real
from ..._files import write_csv, write_text

__all__ = ["MetricsLogger", "read_metrics", "truncate_metrics"]


def read_metrics(path) -> List[Dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (a torn last line from a killed process is skipped)."""
    path = Path(path)
    out: List[Dict[str, Any]] = []
    if not path.is_file():
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def truncate_metrics(path, max_step: int) -> None:
    """Keep the records with ``step <= max_step`` (used when resuming from that step)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if int(r.get("step", 0)) <= max_step]
    write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


class MetricsLogger:
    """Appends records to ``<run>/metrics.jsonl`` (main process only; others get ``enabled=False``)."""

    def __init__(self, run_dir, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self._tb = None
        if enabled and self.path.is_symlink():  # appending would write through it (a dangling one: create its target)
            write_text(self.path, self.path.read_text(encoding="utf-8") if self.path.is_file() else "")
        self._f = open(self.path, "a", encoding="utf-8") if enabled else None

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled or self._f is None:
            return
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None:
            step = int(record.get("step", 0))
            for k, v in record.items():
                if k != "step" and is_real(v):
                    self._tb.add_scalar(k.replace("_", "/", 1), v, step)

    def close(self, csv_path: Optional[Path] = None) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.enabled and csv_path is not None:
            write_csv(csv_path, read_metrics(self.path))
