"""benchmarks/triton_matrix.py (``make triton-matrix``): each Triton wheel is downloaded once and
installed outside the environment (or named with ``--dirs``); the committed matrix covers every
release from 3.3 to 3.9, each compiling without a stack frame and passing the interpreter tests
where they were run."""
import json
from pathlib import Path

from benchmarks import triton_matrix
from benchmarks.kernels.compile_check import Result, Spec, summary

ROOT = Path(__file__).resolve().parents[1]


def test_install_downloads_each_wheel_once_into_the_cache(tmp_path, monkeypatch):
    calls = []

    def pip(*args):
        calls.append(args)
        if args[0] == "download":
            (tmp_path / "wheels" / "triton-3.6.0-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
        else:
            Path(args[args.index("--target") + 1], "triton").mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(triton_matrix, "_pip", pip)
    (tmp_path / "wheels").mkdir()
    target = triton_matrix.install("3.6.0", tmp_path)
    assert target == tmp_path / "triton-3.6.0"
    assert [c[0] for c in calls] == ["download", "install"]
    install = calls[1]
    assert install[install.index("--target") + 1] == str(target) and "--no-index" in install and "--no-deps" in install
    assert triton_matrix.install("3.6.0", tmp_path) == target and len(calls) == 2  # installed: nothing to do
    (target / ".whiteformer-installed").unlink()
    triton_matrix.install("3.6.0", tmp_path)
    assert [c[0] for c in calls[2:]] == ["install"]  # the wheel is cached: no second download


def test_summary_counts_failures_and_spills():
    spec, other = Spec("pkg.m.k", (("x", "*fp32"),), (), (), ()), Spec("pkg.n.k", (("x", "*fp32"),), (), (), ())
    results = [Result(spec, 80, reg=100, stack=0), Result(spec, 90, reg=255, stack=8), Result(spec, 90, error="boom"),
               Result(other, 80, reg=90, stack=0)]
    s = summary(results)
    assert (s["compiles"], s["ok"], s["failed"], s["spilled"], s["max_stack"], s["max_registers"]) == (4, 3, 1, 1, 8, 255)
    assert len(s["failures"]) == 2
    assert s["kernels"]["m.k"] == {"compiles": 3, "ok": 2, "failed": 1, "spilled": 1, "max_stack": 8,
                                   "max_registers": 255}
    assert s["kernels"]["n.k"]["spilled"] == 0 and s["kernels"]["n.k"]["max_stack"] == 0


def test_dirs_name_installed_releases(tmp_path, capsys):
    """``--dirs``: each folder's Triton version comes from its dist-info; a folder that is not a
    ``pip install --target`` of triton is a usage error naming it."""
    (tmp_path / "t" / "triton-3.7.1.dist-info").mkdir(parents=True)
    assert triton_matrix.installed_version(tmp_path / "t") == "3.7.1"
    (tmp_path / "empty").mkdir()
    try:
        triton_matrix.main(["--dirs", str(tmp_path / "empty"), "--out", str(tmp_path / "out.json")])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("no usage error")
    assert "--dirs" in capsys.readouterr().err and not (tmp_path / "out.json").exists()


def test_committed_matrix_covers_every_release_without_failures():
    matrix = json.loads((ROOT / "benchmarks" / "results" / "triton_matrix.json").read_text())
    results = {r["triton"]: r for r in matrix["results"]}
    assert set(triton_matrix.VERSIONS) <= set(results)
    framed = set()
    for version in triton_matrix.VERSIONS:
        comp, tests = results[version]["compile"], results[version].get("interpreter")
        assert comp["failed"] == 0 and comp["ok"] == comp["compiles"] > 0, (version, comp)
        kernels = comp.get("kernels", {})
        framed |= {(version, k) for k, v in kernels.items() if v["spilled"]}
        assert comp["max_stack"] == 0 and comp["spilled"] == 0, (version, comp)
        assert tests is None or (tests["failed"] == 0 and tests["passed"] > 0), (version, tests)
    assert not framed, framed  # no kernel has a stack frame under any release
    table = triton_matrix.table(matrix["results"])
    assert all(f"| {v} |" in table for v in triton_matrix.VERSIONS)


def _fake_compile(job):
    """A compile that kills its worker process for the kernel named "crash"."""
    import os

    spec, cc = job
    if spec["kernel"] == "m.crash":
        os._exit(1)
    return {"reg": 1, "stack": 0, "shared": 0}


def test_a_compiler_crash_is_one_failure_not_a_lost_run(tmp_path, monkeypatch):
    """A compile that kills its worker (Triton's compiler aborting) is reported as that one
    specialisation's failure; every other result is kept."""
    from dataclasses import asdict

    from benchmarks.kernels import compile_check

    monkeypatch.setattr(compile_check, "_compile_one", _fake_compile)
    specs = [Spec(f"m.{k}", (("x", "*fp32"),), (), (), ()) for k in ("a", "crash", "b")]
    (tmp_path / "specs.json").write_text(json.dumps({"specs": [asdict(s) for s in specs], "ccs": [80, 90]}))
    compile_check._child(str(tmp_path / "specs.json"), str(tmp_path / "out.json"), 2)
    out = json.loads((tmp_path / "out.json").read_text())
    assert [("error" in r) for r in out] == [False, False, True, True, False, False]
    assert all("crashed" in r["error"] for r in out if "error" in r)
