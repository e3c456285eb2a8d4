"""Progress of :func:`~whiteformer.compress.compress`, one step per compressed block.

On a terminal a tqdm bar (block i/n, the block's QK rank and relative error); otherwise (a log
file, a pipe) one line per block, so that a long IrrAtt run is never silent and logs stay readable.
"""
from __future__ import annotations

import sys
from typing import Optional, TextIO

__all__ = ["BlockProgress"]


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
        self.bar = None
        if enabled and total and getattr(self.file, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="compress", unit="block", dynamic_ncols=True, file=self.file)

    def update(self, index: int, method: Optional[str], rank: Optional[int], qk_error: Optional[float],
               seconds: float) -> None:
        """Block ``index`` (its position in the model) is done: QK ``method``, total ``rank`` and error."""
        self.done += 1
        if not self.enabled:
            return
        err = "exact" if qk_error is None else f"{qk_error:.4f}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"block {index}: rank {rank}, QK error {err}", refresh=False)
            self.bar.update(1)
            return
        print(f"compress: block {self.done}/{self.total} (index {index}): {method or 'QK exact'}, rank {rank}, "
              f"QK error {err}, {seconds:.2f} s", file=self.file, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "BlockProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
