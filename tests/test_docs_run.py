"""Every ```python block of README.md and docs/*.md runs as written.

A block runs on its own, in a fresh namespace and an empty working directory, offline (no Hub). A
block that goes on from the one above says so with ``<!-- continues -->`` on the line before its
fence: the chain runs in one namespace. A block that cannot run here says why with
``<!-- skip: REASON -->`` (a user's own Hub repository, a GPU); there are few such blocks, each with
its reason. A chain importing an optional package that is not installed (timm, onnxruntime, ...) is
skipped naming that package, found at run time.

Commands that need a clone of the repository (``python -m benchmarks.*``, ``make ...``) say so in
their paragraph.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(continues|skip:\s*(?P<reason>.*?))\s*-->\s*$")
#: at most this many blocks may be marked ``skip`` (placeholders are the exception)
MAX_SKIPPED = 3


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, from 1
    code: str
    continues: bool = False
    skip: Optional[str] = None


@dataclass
class Chain:
    blocks: List[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.blocks[0].page}:{self.blocks[0].line}"


def read_blocks(path: Path) -> List[Block]:
    """The ```python blocks of a page with the marker on the line before each fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT).as_posix()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            block = Block(rel, start + 1, "\n".join(lines[start + 1:j]) + "\n")
            prev = lines[start - 1].strip() if start else ""
            m = MARKER.match(prev)
            if m and m.group(1) == "continues":
                block.continues = True
            elif m:
                block.skip = m.group("reason")
            out.append(block)
            i = j
        i += 1
    return out


def all_blocks() -> List[Block]:
    return [b for page in PAGES for b in read_blocks(page)]


def chains() -> List[Chain]:
    out: List[Chain] = []
    for page in PAGES:
        for b in read_blocks(page):
            if b.continues and out and out[-1].blocks[0].page == b.page:
                out[-1].blocks.append(b)
            else:
                out.append(Chain([b]))
    return out


def missing_modules(code: str) -> List[str]:
    """The top-level packages ``code`` imports that are not installed."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None)


CHAINS = chains()


def test_the_pages_have_python_blocks_and_their_markers_are_sound():
    blocks = all_blocks()
    assert len(blocks) >= 20, [b.page for b in blocks]
    for page in PAGES:
        first = read_blocks(page)[:1]
        assert not (first and first[0].continues), f"{first[0].page}:{first[0].line} continues no block"
    skipped = [b for b in blocks if b.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, [f"{b.page}:{b.line}: {b.skip}" for b in skipped]
    for b in skipped:
        assert len(b.skip.split()) >= 2, f"{b.page}:{b.line}: a skipped block says why"
    # a marker always sits right before a python fence (a stray one would be silently ignored)
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, text in enumerate(lines):
            if MARKER.match(text.strip()):
                nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
                assert nxt == "```python", f"{page.name}:{i + 1}: a marker not followed by a python block"
            if text.strip() == "```python" and i and lines[i - 1].strip().startswith("<!--"):
                assert MARKER.match(lines[i - 1].strip()), (f"{page.name}:{i}: unknown marker {lines[i - 1]!r}; "
                                                            f"use <!-- continues --> or <!-- skip: REASON -->")


@pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])
def test_block_runs(chain: Chain, tmp_path, monkeypatch):
    for b in chain.blocks:
        if b.skip is not None:
            pytest.skip(f"{b.page}:{b.line}: {b.skip}")
    code = "".join(b.code for b in chain.blocks)
    missing = missing_modules(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__docs__"}
    for b in chain.blocks:
        exec(compile(b.code, f"{b.page}:{b.line}", "exec"), ns)  # noqa: S102 - the documentation's own code


CLONE_ONLY = re.compile(r"python -m (benchmarks|experiments)\b|(`|^)make [a-z]", re.MULTILINE)
SAYS_CLONE = re.compile(r"\ba clone\b", re.IGNORECASE)


def paragraphs(text: str):
    """Paragraphs of a page; a fenced block joined with the paragraph before it."""
    parts, cur, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and not line.strip() and cur:
            parts.append("\n".join(cur))
            cur = []
            continue
        cur.append(line)
    if cur:
        parts.append("\n".join(cur))
    merged: List[str] = []
    for p in parts:
        if p.lstrip().startswith("```") and merged:
            merged[-1] += "\n" + p
        else:
            merged.append(p)
    return merged


#: pages written by a generator from result files: one statement near the top covers the page
GENERATED = {"benchmarks.md", "results.md"}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_clone_only_commands_say_they_need_a_clone(page):
    paras = paragraphs(page.read_text(encoding="utf-8"))
    said = False
    for para in paras:
        said = said or bool(SAYS_CLONE.search(para))
        if CLONE_ONLY.search(para):
            ok = said if page.name in GENERATED else SAYS_CLONE.search(para)
            assert ok, f"{page.name}: a command that needs a clone, without saying so:\n{para}"
