"""The package's layering, read from the source (ast, no imports run): no module imports a package of
a higher layer (docs/architecture.md), no import cycles inside any package, and the attention
registry does not depend on what was imported first."""
import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "whiteformer"

# Layer of each top-level package/module of whiteformer (docs/architecture.md): a module may import its
# own package and packages of a strictly lower layer only. Function-level (lazy) imports count too.
LAYERS = {
    "_compile": 0,
    "_dtypes": 0,
    "_checks": 0.5,  # the argument checks use the two helpers above
    "_files": 0,
    "_nesting": 0,
    "_progress": 0,
    "_utils": 0,
    "_registry": 0,
    "_import_hooks": 0,
    "_version": 0,
    "ops": 1,
    "attention": 2,
    "layers": 3,
    "models": 4,
    "analysis": 5,
    "convert": 6,  # transformers checkpoints -> the zoo's models (reads transformers' files, imports no transformers)
    "hf": 7,
    "compress": 7,
    "timm": 7,
    "app": 8,
    "__main__": 9,
    "__init__": 9,
}
# The application (the command line, its configuration, training, run directories, data sets, the
# demo, shipped configs, experiments) and its ``python -m whiteformer`` entry; the rest is the library.
APPLICATION = ("app", "__main__")
NO_CYCLES = tuple(sorted(p for p in LAYERS if (PKG / p).is_dir()))


def _modules():
    """{dotted module name: path} of every module under src/whiteformer."""
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom):
    """Absolute dotted names imported by ``from ... import ...`` in ``module``."""
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    names = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        names.append(sub if sub in MODULES else target)
    return names


def _walk(tree, functions: bool):
    """The nodes of ``tree``; without ``functions``, not those in a function body (what runs at import)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if functions or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def _imports(functions: bool = True):
    """{module: {imported whiteformer module: first line}} (module level, and inside functions unless
    ``functions`` is False)."""
    graph = defaultdict(dict)
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        is_pkg = path.name == "__init__.py"
        for node in _walk(tree, functions):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(mod, is_pkg, node)
            else:
                continue
            for t in targets:
                if t == "whiteformer" or t.startswith("whiteformer."):
                    graph[mod].setdefault(t, node.lineno)
    return graph


def _top(module: str) -> str:
    """The entry of LAYERS that ``module`` belongs to: its module when LAYERS names it, else its package."""
    parts = module.split(".")
    if ".".join(parts[1:3]) in LAYERS:
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer():
    tops = {_top(m) for m in MODULES}
    missing = sorted(tops - set(LAYERS))
    assert not missing, (f"whiteformer.{missing} have no layer in tests/test_import_layers.py LAYERS; add them "
                         "(and to docs/architecture.md)")


def test_no_upward_imports():
    bad = []
    for mod, targets in _imports().items():
        src = _top(mod)
        for t, line in targets.items():
            dst = _top(t) if t != "whiteformer" else "__init__"
            if dst == src or t == "whiteformer" and src in ("__init__", "__main__"):
                continue
            if LAYERS.get(dst, 99) >= LAYERS.get(src, 99):
                bad.append(f"{MODULES[mod].relative_to(SRC)}:{line}: {mod} ({src}, layer {LAYERS.get(src)}) imports "
                           f"{t} ({dst}, layer {LAYERS.get(dst)})")
    assert not bad, "imports that run up (or sideways) the layering:\n" + "\n".join(sorted(bad))


def test_the_library_never_imports_the_application():
    """No module of the library (ops, attention, layers, models, analysis, compress, hf and the
    top-level helpers) imports whiteformer.app, not even inside a function."""
    bad = [f"{MODULES[mod].relative_to(SRC)}:{line}: {mod} imports {t}"
           for mod, targets in _imports().items() if _top(mod) not in APPLICATION
           for t, line in targets.items() if _top(t) in APPLICATION]
    assert not bad, "the library imports the application:\n" + "\n".join(sorted(bad))


def test_the_library_check_sees_a_lazy_import_of_the_application():
    """The checker itself: an import of whiteformer.app inside a library function is found."""
    tree = ast.parse("def f():\n    from ..app.train import train\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    (target,) = _resolve("whiteformer.compress.model", False, node)
    assert _top(target) in APPLICATION and _top("whiteformer.compress.model") not in APPLICATION


def _cycles(graph, nodes):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def _with_packages(module, targets):
    """``targets`` plus the packages whose ``__init__`` importing them runs: importing ``a.b.c`` from
    outside ``a.b`` first imports ``a.b``, so a cycle through that ``__init__`` at import time is a cycle
    too (a function's import runs once every package is loaded)."""
    out = set(targets)
    for t in targets:
        parts = t.split(".")
        for i in range(2, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg in MODULES and not (module == pkg or module.startswith(pkg + ".")):
                out.add(pkg)
    return out


@pytest.mark.parametrize("package", NO_CYCLES)
def test_no_cycles_inside(package):
    prefix = f"whiteformer.{package}"
    nodes = {m for m in MODULES if m == prefix or m.startswith(prefix + ".")}
    at_import = _imports(functions=False)
    graph = {m: {t for t in {*targets, *_with_packages(m, at_import.get(m, {}))} if t in nodes and t != prefix}
             for m, targets in _imports().items() if m in nodes}
    # a package __init__ importing its submodules is not a cycle by itself; submodule -> package is
    graph[prefix] = {t for t in _imports().get(prefix, {}) if t in nodes and t != prefix}
    cycles = _cycles(graph, nodes)
    assert not cycles, f"import cycles inside {prefix}: {cycles}"


def test_graph_checker_catches_an_upward_import(tmp_path):
    """The checker itself: a models -> compress arrow is reported (it did exist in models/deit.py)."""
    tree = ast.parse("def f():\n    from ..compress.model import compress\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    (target,) = _resolve("whiteformer.models.deit", False, node)
    assert target == "whiteformer.compress.model"
    assert LAYERS[_top(target)] > LAYERS[_top("whiteformer.models.deit")]


def test_a_cycle_through_a_package_init_is_a_cycle():
    """Importing app.train.trainer from app.config runs app/train/__init__ first (which imports
    app.config: a cycle); from inside app.train it does not."""
    assert "whiteformer.app.train" in _with_packages("whiteformer.app.config", {"whiteformer.app.train.trainer"})
    assert "whiteformer.app.train" not in _with_packages("whiteformer.app.train.build",
                                                         {"whiteformer.app.train.trainer"})


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}, {"a", "b", "c"}) == [["a", "b"]]


@pytest.mark.parametrize("first", ["whiteformer.attention.registry", "whiteformer.compress", "whiteformer.models",
                                   "whiteformer.analysis"])
def test_attention_registry_same_whatever_is_imported_first(first):
    """A fresh interpreter that imports ``first`` and then asks the registry sees every layer (the
    compressed layers used to register only when whiteformer.compress was imported)."""
    import whiteformer.attention

    code = (f"import importlib; importlib.import_module({first!r}); "
            "from whiteformer.attention.registry import list_attention; print(','.join(list_attention()))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    names = out.stdout.strip().splitlines()[-1].split(",")
    assert names == [n for n in whiteformer.attention.list_attention() if not n.startswith("_")]
    assert {"truncatt", "irratt", "cp_slimatt", "tssa", "mhsa"} <= set(names)


@pytest.mark.parametrize("module", ["whiteformer.app.config", "whiteformer.app.train", "whiteformer.app.cli"])
def test_an_application_module_imports_first(module):
    """A fresh interpreter can import ``module`` before anything else (``app.config`` used to import
    the ``app.train`` package, whose modules import ``app.config``: an ImportError unless something
    else had imported the train package first)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr


# One copy of each small helper: the checks live in _checks.py, the module helpers in _utils.py.
SINGLE_HOME = {"is_int": "_checks", "is_real": "_checks", "check_int": "_checks", "check_probability": "_checks",
               "eval_mode": "_utils", "count_params": "_utils", "to_jsonable": "_utils",
               "atomic_write": "_files", "save_figure": "_files",
               "write_csv": "_files"}
# local look-alikes the helpers replaced (names of the former copies)
FORMER_COPIES = {"_check_prob", "_check_rate", "_check_dropout", "check_attn_drop", "_n_params", "_jsonable"}


def _function_defs():
    """[(function name, module, line)] of every def in src/whiteformer."""
    out = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.name, mod, node.lineno))
    return out


def test_helpers_are_defined_once():
    defs = _function_defs()
    for name, home in SINGLE_HOME.items():
        where = [(m, line) for n, m, line in defs if n == name]
        assert [m for m, _ in where] == [f"whiteformer.{home}"], \
            f"{name} must be defined once, in whiteformer/{home}.py; found {where}"
    copies = [f"{m}:{line} {n}" for n, m, line in defs if n in FORMER_COPIES]
    assert not copies, f"local copies of shared helpers (use whiteformer._checks / whiteformer._utils): {copies}"


def test_bool_is_not_int_is_checked_by_the_helper():
    """``isinstance(v, bool) or not isinstance(v, int)`` and its variants are spelled is_int / is_real."""
    import re

    pattern = re.compile(r"isinstance\([\w.\[\]]+, bool\)\s*(or not|and not)\s*isinstance|"
                         r"isinstance\([\w.\[\]]+, [^)]*\)\s*(or|and not)\s*isinstance\([\w.\[\]]+, bool\)")
    bad = [f"{path.relative_to(SRC)}:{i}" for mod, path in MODULES.items() if not mod.endswith("._checks")
           for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not bad, f"use whiteformer._checks.is_int / is_real instead: {bad}"
