"""The public API is listed once, in docs/api.md's table: each row is a package's ``__all__``
(same names, same order), every listed name imports, and every package of whiteformer has an
explicit ``__all__``."""
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "whiteformer"


def _api_rows():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    section = text.split("\n## ", 1)[0]  # the table, before the page's other sections
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(whiteformer[\w.]*)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = re.findall(r"`([^`]+)`", m.group(2))
    return rows


ROWS = _api_rows()


def test_the_api_section_lists_the_main_packages():
    assert {"whiteformer", "whiteformer.ops", "whiteformer.attention", "whiteformer.layers", "whiteformer.models",
            "whiteformer.app.data", "whiteformer.analysis", "whiteformer.app.train", "whiteformer.compress"} <= set(ROWS)


@pytest.mark.parametrize("module", sorted(ROWS))
def test_readme_row_is_the_package_all_and_every_name_imports(module):
    mod = importlib.import_module(module)
    assert ROWS[module] == list(mod.__all__), f"docs/api.md's row of {module} differs from its __all__"
    missing = [n for n in ROWS[module] if not hasattr(mod, n)]
    assert not missing, f"{module} does not define {missing}"


def test_every_package_declares_all():
    missing = []
    for init in sorted(PKG.rglob("__init__.py")):
        if not re.search(r"^__all__\s*[:=]", init.read_text(encoding="utf-8"), flags=re.M):
            missing.append(str(init.relative_to(PKG.parent)))
    assert not missing, f"packages without an explicit __all__: {missing}"
