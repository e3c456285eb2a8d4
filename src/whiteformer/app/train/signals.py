"""Stopping a run cleanly on Ctrl-C (SIGINT) or SIGTERM: the handler only records the request;
the trainer finishes the optimizer step in progress, writes an (atomic) checkpoint and raises
:class:`RunInterrupted`, so ``--resume`` continues from that step."""
from __future__ import annotations

import signal
import threading
from typing import Dict, Optional

__all__ = ["StopRequest", "RunInterrupted"]


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal after saving a checkpoint; ``exit_code`` = 128 + signal number."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + int(signum)


class StopRequest:
    """Context manager: while active, SIGINT / SIGTERM set :attr:`signum` instead of stopping the
    process (outside the main thread it does nothing: signals are delivered there)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
