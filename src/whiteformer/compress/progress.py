"""Progress of :func:`~whiteformer.compress.compress`, one step per compressed block.

On a terminal a tqdm bar (block i/n, elapsed time and ETA, the block's QK ranks and relative error);
otherwise (a log file, a pipe) one line per block with the time so far and the ETA, so that a long
IrrAtt run is never silent and logs stay readable. The QK ranks are shown per head, as in the report's
per-block table, with their total over the heads.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, Sequence, TextIO

from .._progress import NO_BAR, is_terminal, progress_bar

__all__ = ["BlockProgress", "format_ranks"]


def format_ranks(ranks: Optional[Sequence[int]], total: Optional[int]) -> str:
    """``"QK ranks (per head) 32,32,32, total 96"`` (the labels of the report's table)."""
    if ranks is None:
        return "QK ranks n/a"
    text = f"QK ranks (per head) {','.join(str(int(r)) for r in ranks)}"
    return text if total is None else f"{text}, total {int(total)}"


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


class BlockProgress:
    """``update(...)`` after each block; ``close()`` at the end (also as a context manager).

    Args:
        total: number of blocks to compress.
        enabled: False prints nothing.
        file: the stream (default ``sys.stderr``); a tqdm bar only when it is a terminal.
    """

    def __init__(self, total: int, *, enabled: bool = True, file: Optional[TextIO] = None):
        self.total, self.enabled, self.done = total, enabled, 0
        self.file = sys.stderr if file is None else file
        self.start = time.perf_counter()
        self.bar = progress_bar(total, "compress", "block", enabled=enabled, file=self.file)
        self.lines = enabled and not is_terminal(self.file)

    def update(self, index: int, method: Optional[str], ranks: Optional[Sequence[int]], total_rank: Optional[int],
               qk_error: Optional[float], seconds: float) -> None:
        """Block ``index`` (its position in the model) is done: QK ``method``, per-head ``ranks`` and
        their ``total_rank``, the QK relative error (None: exact) and the block's ``seconds``."""
        self.done += 1
        if not self.enabled:
            return
        err = "exact" if qk_error is None else f"{qk_error:.4f}"
        ranks_text = format_ranks(ranks, total_rank)
        if self.bar is not NO_BAR:
            self.bar.set_postfix_str(f"block {index}: {ranks_text}, QK error {err}", refresh=False)
            self.bar.update(1)
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        print(f"compress: block {self.done}/{self.total} (index {index}): {method or 'QK exact'}, {ranks_text}, "
              f"QK error {err}, {seconds:.2f} s; elapsed {_duration(elapsed)}, ETA {_duration(eta)}",
              file=self.file, flush=True)

    def close(self) -> None:
        self.bar.close()
        self.bar = NO_BAR

    def __enter__(self) -> "BlockProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
