"""whiteformer._import_hooks.when_imported: a hook runs once, right after the module executed (or at
once if it already is imported); a failing hook warns and the import goes on."""
import importlib
import sys

import pytest

from whiteformer._import_hooks import when_imported


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A fresh importable module name on sys.path."""
    name = f"wf_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text("VALUE = 41\nSTEPS = ['ran']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_hook_runs_once_after_the_module_executed(probe):
    seen = []
    when_imported(probe, lambda: seen.append(sys.modules[probe].VALUE))
    assert seen == []  # nothing imported yet
    mod = importlib.import_module(probe)
    assert seen == [41] and mod.STEPS == ["ran"]
    importlib.import_module(probe)
    assert seen == [41]  # once
    when_imported(probe, lambda: seen.append("now"))  # already imported: at once
    assert seen == [41, "now"]


def test_a_failing_hook_warns_and_the_import_goes_on(probe):
    def boom():
        raise RuntimeError("no")

    when_imported(probe, boom)
    with pytest.warns(RuntimeWarning, match="registering with .* failed"):
        mod = importlib.import_module(probe)
    assert mod.VALUE == 41
