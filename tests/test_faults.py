"""Faults a killed or concurrent process can cause: nothing left behind may hang or
corrupt the next run.

Kernel build lock: the fused CPU kernel is built under an OS lock (released when its owner dies);
a lock file left by a killed build is removed; a process waiting for another one's build says so
and gives up after a timeout (PyTorch path). Most tests build a tiny extension in a temporary
cache instead of the ~1 min kernel build."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from whiteformer.ops._kernels import build

TINY = textwrap.dedent("""
    #include <Python.h>
    static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "wf_tiny", NULL, -1, NULL};
    PyMODINIT_FUNC PyInit_wf_tiny(void) { return PyModule_Create(&tiny); }
""")


def _env(cache, **extra):
    env = dict(os.environ, WHITEFORMER_KERNEL_CACHE=str(cache), **extra)
    env.pop("WHITEFORMER_DISABLE_KERNELS", None)
    return env


def _python(code, env, timeout):
    """Run ``code`` in a fresh interpreter; fails the test if it does not finish in ``timeout`` s."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=timeout)


LOAD_TINY = """
    from pathlib import Path
    from whiteformer.ops._kernels.build import load_cpp_extension
    mod = load_cpp_extension("wf_tiny", Path({src!r}), timeout={timeout})
    print("loaded", mod.__name__, mod.__file__)
"""

HOLD_LOCK = """
    import fcntl, os, sys, time
    directory = sys.argv[1]
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, sys.argv[2]), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the OS lock a building process holds
    open(os.path.join(directory, "lock"), "w").close()  # torch's own lock file, as during a real build
    print("held", flush=True)
    time.sleep(600)
"""


def _hold(directory, env):
    """A process holding the build lock of ``directory`` (as one in the middle of a build)."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_LOCK), str(directory), build.LOCK_FILE],
                            env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _tiny(tmp_path, sub="src"):
    src = tmp_path / sub / "wf_tiny.cpp"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(TINY)
    return src


def test_killed_build_lock_holder_does_not_block_the_next_process(tmp_path):
    cache, src = tmp_path / "cache", _tiny(tmp_path)
    env = _env(cache)
    directory = cache / build.extension_dir("wf_tiny", src.read_bytes(), (), ()).name
    holder = _hold(directory, env)
    try:
        # while the holder lives: a waiting message, then a timeout (not a hang)
        start = time.monotonic()
        res = _python(LOAD_TINY.format(src=str(src), timeout=1), env, timeout=60)
        assert res.returncode != 0 and "TimeoutError" in res.stderr, res.stderr
        assert "waiting for another process building the kernel" in res.stderr
        assert time.monotonic() - start < 60
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding the lock, leaving torch's lock file
        holder.wait()
    assert (directory / "lock").exists()
    res = _python(LOAD_TINY.format(src=str(src), timeout=30), env, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "loaded wf_tiny" in res.stdout and str(directory) in res.stdout
    assert "building the kernel (once per environment" in res.stderr
    assert not (directory / "lock").exists()


def test_built_extension_is_reused_from_another_checkout(tmp_path):
    """The build key is the source text and flags, not its path: a second checkout reuses it."""
    cache = tmp_path / "cache"
    first, second = _tiny(tmp_path, "checkout_a"), _tiny(tmp_path, "checkout_b")
    env = _env(cache)
    res = _python(LOAD_TINY.format(src=str(first), timeout=30), env, timeout=180)
    assert res.returncode == 0 and "building the kernel" in res.stderr, res.stderr
    so = next(cache.glob("*/wf_tiny.so"))
    built_at = so.stat().st_mtime_ns
    res = _python(LOAD_TINY.format(src=str(second), timeout=30), env, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "building" not in res.stderr and str(so) in res.stdout
    assert so.stat().st_mtime_ns == built_at  # not rebuilt
    # a changed source is another build
    second.write_text(TINY + "\n// changed\n")
    res = _python(LOAD_TINY.format(src=str(second), timeout=30), env, timeout=180)
    assert res.returncode == 0 and "building the kernel" in res.stderr, res.stderr
    assert len(list(cache.glob("*/wf_tiny.so"))) == 2


def test_build_wait_times_out_to_the_pytorch_path(tmp_path):
    """Another process holds the TSSA kernel's build lock: the ops warn and run the PyTorch path."""
    cache = tmp_path / "cache"
    env = _env(cache, WHITEFORMER_KERNEL_BUILD_TIMEOUT="1")
    args = build.tssa_build_args()
    directory = cache / build.extension_dir(args["name"], args["source"].read_bytes(), args["cflags"],
                                            args["ldflags"]).name
    holder = _hold(directory, env)
    try:
        res = _python("""
            import warnings, torch
            from whiteformer.ops import tssa
            from whiteformer.ops._kernels import fused_supported
            from whiteformer.ops.reference import tssa_reference
            w, temp = torch.randn(2, 3, 5, 4), torch.rand(3, 1) + 0.5
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = tssa(w, temp)
            assert not fused_supported(w)
            torch.testing.assert_close(out, tssa_reference(w, temp), rtol=1e-5, atol=1e-6)
            print("|".join(str(c.message) for c in caught))
        """, env, timeout=120)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert res.returncode == 0, res.stderr
    assert "waiting for another process building the kernel" in res.stderr
    assert "using the pure-PyTorch path" in res.stdout and "TimeoutError" in res.stdout


def test_stale_torch_lock_file_no_longer_hangs():
    """The reproducer: ``touch <cache>/<tag>/lock`` (what a build killed inside torch's
    cpp_extension.load leaves) made every later process wait forever. Uses the configured kernel
    cache (where the rest of the suite builds the kernel) to avoid a second ~1 min build."""
    args = build.tssa_build_args()
    directory = build.extension_dir(args["name"], args["source"].read_bytes(), args["cflags"], args["ldflags"])
    directory.mkdir(parents=True, exist_ok=True)
    stale = directory / "lock"
    stale.touch()
    try:
        res = _python("""
            from whiteformer.ops._kernels.build import build_error, load_extension
            assert load_extension() is not None, build_error()
            print("loaded")
        """, _env(build.cache_root()), timeout=300)
        assert res.returncode == 0 and "loaded" in res.stdout, res.stderr
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_bad_build_timeout_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(build.ENV_TIMEOUT, "soon")
    with pytest.raises(ValueError, match="WHITEFORMER_KERNEL_BUILD_TIMEOUT must be a number of seconds"):
        build._timeout()
    monkeypatch.setenv(build.ENV_TIMEOUT, "2.5")
    assert build._timeout() == 2.5


# ----------------------------------------------------------------------------- build key
def test_build_key_covers_the_environment(monkeypatch):
    """Two virtual environments with the same torch read headers from different paths (written into
    build.ninja): each must get its own directory, not rebuild the other's binary in turn."""
    from torch.utils import cpp_extension

    args = ("wf_tiny", TINY.encode(), ("-O2",), ())
    env = build.build_environment()
    assert env["prefix"] and env["torch_include"] == cpp_extension.include_paths() and env["cxx"]
    same = build.extension_dir(*args)
    assert build.extension_dir(*args) == same == build.extension_dir(*args, environment=env)
    for key, other in (("torch_include", ["/other/venv/torch/include"]), ("prefix", "/other/venv"),
                       ("cxx", "/usr/bin/clang++"), ("python_abi", "cpython-312.so"), ("torch", "9.9.9")):
        assert build.extension_dir(*args, environment={**env, key: other}) != same, key
    assert build.extension_dir("wf_tiny", TINY.encode(), ("-O3",), ()) != same  # flags
    assert build.extension_dir("wf_tiny", (TINY + "//").encode(), ("-O2",), ()) != same  # source
    # the default environment follows what cpp_extension would compile with
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/elsewhere/torch/include"])
    assert build.extension_dir(*args) != same
    monkeypatch.setenv("CXX", "/nonexistent/g++-99")
    assert build.build_environment()["cxx"] == "/nonexistent/g++-99"


def test_building_message_whenever_a_build_runs(tmp_path, monkeypatch, capsys):
    """The message is printed when ninja really has work, also when a binary already exists (a
    changed input), and not when it has none. The compile step is replaced by a trivial ninja rule."""
    import shutil
    import subprocess
    import types

    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        pytest.skip("needs ninja")
    monkeypatch.setenv("WHITEFORMER_KERNEL_CACHE", str(tmp_path / "cache"))
    runs = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        with open(os.path.join(build_directory, "build.ninja"), "w") as f:
            f.write(f"rule cp\n  command = cp $in $out\nbuild {name}.so: cp {sources[0]}\n")
        res = subprocess.run(["ninja", "-C", build_directory], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
        runs.append("no work to do" not in res.stdout)
        return types.SimpleNamespace(__name__=name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    src = _tiny(tmp_path)
    build.load_cpp_extension("wf_tiny", src, timeout=5)
    assert "building the kernel" in capsys.readouterr().err and runs == [True]
    build.load_cpp_extension("wf_tiny", src, timeout=5)
    assert "building" not in capsys.readouterr().err and runs == [True, False]
    directory = build.extension_dir("wf_tiny", src.read_bytes(), (), ())
    local = directory / src.name
    os.utime(local, (time.time() + 5, time.time() + 5))  # an input newer than the binary: ninja rebuilds
    assert (directory / "wf_tiny.so").exists()
    build.load_cpp_extension("wf_tiny", src, timeout=5)
    assert "building the kernel" in capsys.readouterr().err and runs == [True, False, True]
