"""One part's result file: rows saved as they are measured, so a part stopped at its time budget
(or crashed) keeps what it had finished."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

from .. import common


class Recorder:
    """``{"part", "status", "rows", ...}`` in ``path``, rewritten whole after each change."""

    def __init__(self, path: Path, part: str):
        self.path = Path(path)
        self.data: Dict[str, Any] = {"part": part, "status": "running", "rows": []}
        self._t0 = time.time()
        self.save()

    @property
    def rows(self) -> List[Dict[str, Any]]:
        return self.data["rows"]

    def add(self, row: Dict[str, Any]) -> None:
        self.rows.append(row)
        self.save()

    def set(self, **items: Any) -> None:
        self.data.update(items)
        self.save()

    def save(self) -> None:
        self.data["wall_s"] = round(time.time() - self._t0, 2)
        common.write_json(self.path, self.data)


def describe(e: BaseException) -> str:
    """``Type: first line of the message`` (bounded), for a result row."""
    text = str(e).splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"
