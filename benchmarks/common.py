"""Shared helpers of the benchmark suite: machine description, timing, peak memory, isolated
child processes, JSON output and small formatting utilities.

Memory. On CPU the peak resident set size (RSS) of the process is measured around one call:
the heap is trimmed (``malloc_trim``), the current RSS is the baseline, the kernel's high-water
mark ``VmHWM`` is reset by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), and after
the call the reported value is ``VmHWM - baseline``. Where that reset is unavailable the delta of
``resource.getrusage(...).ru_maxrss`` is used (an under-estimate when the process had a higher
peak earlier; marked in the results). On CUDA, ``torch.cuda.max_memory_allocated`` minus the
allocated memory before the call is used.

Isolation. Each configuration runs in its own child process (:func:`run_isolated`), forked from a
``forkserver`` that has imported torch but never ran a kernel (forking a process whose OpenMP
pool is running can hang the child). This keeps the peak-memory measurements of different
configurations apart and costs ~50 ms per child instead of a fresh ``import torch``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import math
import multiprocessing as mp
import os
import platform
import resource
import shlex
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch

from whiteformer._files import save_figure, write_text  # noqa: F401 - the benchmarks write through these

# Children forked from the forkserver re-run the parent's ``__main__`` module (multiprocessing's
# "prepare" step); when that module was preloaded, runpy warns about it. Harmless: silence it.
warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package.*",
                        category=RuntimeWarning)

GiB = 1024 ** 3
MiB = 1024 ** 2
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

# --------------------------------------------------------------------------------------------------
# machine description
# --------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_ram_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def loadavg() -> Optional[List[float]]:
    """1, 5 and 15 minute load averages (None where unsupported)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info(device: str = "cpu") -> Dict[str, Any]:
    """Description of the machine and software the benchmark runs on."""
    ram = total_ram_bytes()
    info = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "ram_gib": round(ram / GiB, 1) if ram else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device,
        "loadavg": loadavg(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def machine_string(info: Dict[str, Any]) -> str:
    s = f"{info['cpu']}, {info['logical_cpus']} logical CPUs, {info['ram_gib']} GiB RAM"
    return s + (f", {info['gpu']}" if "gpu" in info else "")


def resolve_threads(value: Optional[str]) -> tuple:
    """``--threads`` value -> (threads for the measuring processes or None for torch's default,
    reason). ``"auto"``: 1 thread when the machine is busy (1-minute load average >= half the
    logical CPUs: OpenMP threads that wait for a descheduled sibling make small kernels many
    times slower, which we measured at 3-10x on a shared 2-core machine), else torch's default."""
    if value is None or value == "auto":
        load = loadavg()
        cpus = os.cpu_count() or 1
        if load is not None and load[0] >= cpus / 2:
            return 1, f"auto: 1 thread (busy machine: load {load[0]} on {cpus} logical CPUs)"
        return None, f"auto: torch default ({torch.get_num_threads()} threads; load {load and load[0]})"
    n = int(value)
    if n < 1:
        raise ValueError(f"--threads must be >= 1 or 'auto', got {value!r}")
    return n, f"{n} (given)"


def row_env(command: str, device: str = "cpu", threads: Optional[int] = None) -> Dict[str, Any]:
    """The fields every result row carries: machine, threads, torch version, command, load."""
    info = machine_info(device)
    return {
        "machine": machine_string(info),
        "threads": threads if threads is not None else info["threads"],
        "torch": info["torch"],
        "device": device,
        "command": command,
        "loadavg": info["loadavg"],
    }


def int_list(text: str) -> List[int]:
    """An argparse ``type=`` for a comma-separated list of integers ("1,32" -> [1, 32])."""
    return [int(t) for t in text.split(",") if t.strip()]


def command_string(module: str, argv: Sequence[str]) -> str:
    return " ".join(["python", "-m", module] + [shlex.quote(a) for a in argv])


# --------------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------------


def _status_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError):
        pass
    return None


def current_rss() -> Optional[int]:
    """Current resident set size in bytes (Linux), else None."""
    return _status_bytes("VmRSS")


def _ru_maxrss_bytes() -> int:
    v = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return v if sys.platform == "darwin" else v * 1024  # Linux reports kB


def peak_rss() -> int:
    """Peak resident set size in bytes (``VmHWM``, else ``ru_maxrss``)."""
    v = _status_bytes("VmHWM")
    return v if v is not None else _ru_maxrss_bytes()


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_LIBC = None


def trim_heap() -> None:
    """Collect garbage and return free heap memory to the OS (glibc ``malloc_trim``)."""
    global _LIBC
    gc.collect()
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (AttributeError on non-glibc)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def keep_freed_memory() -> bool:
    """glibc: keep freed blocks in the heap for reuse (``mallopt``: mmap and trim thresholds 1 GiB)
    instead of returning each large block to the OS, where the next allocation of that size
    page-faults on first touch. Returns False where unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False


class PeakMemory:
    """Context manager: ``delta`` = peak memory during the block minus the memory before it (bytes).

    ``method`` names how it was measured (see the module docstring)."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.delta: Optional[int] = None
        self.method = ""

    def __enter__(self) -> "PeakMemory":
        trim_heap()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda max_memory_allocated - memory_allocated"
            return self
        rss = current_rss()
        if rss is not None and reset_peak_rss():
            self._base = rss
            self.method = "VmHWM (reset via /proc/self/clear_refs) - VmRSS before"
        else:
            self._base = max(_ru_maxrss_bytes(), rss or 0)
            self.method = "ru_maxrss delta (no peak reset: lower bound)"
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = peak_rss()
        self.delta = max(0, peak - self._base)


def tensor_bytes(obj: Any) -> int:
    """Total bytes of the tensors in a (nested) tuple/list/dict/NamedTuple."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: str = "cpu") -> float:
    """Wall-clock seconds of one call (device synchronised)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def summarize(samples: Sequence[float]) -> Dict[str, Any]:
    return {
        "time_s": statistics.median(samples),
        "time_min_s": min(samples),
        "runs": len(samples),
        "samples_s": [round(s, 6) for s in samples],
    }


def repeat_runs(fn: Callable[[], Any], first_s: float, *, device: str = "cpu", repeats: int = 5,
                budget_s: float = 20.0, long_run_s: float = 15.0, self_timed: bool = False) -> Dict[str, Any]:
    """Timed runs after a first call at this size (``first_s``, itself the warm-up at this size).

    The median of up to ``repeats`` further runs, as many as fit in ``budget_s``. When one run
    takes longer than ``long_run_s`` the first call is the only sample (the process has already
    been warmed up on a small input, so a run that long has negligible first-call overhead).
    ``self_timed``: ``fn()`` returns its own time (e.g. when it also runs something untimed)."""
    if first_s > long_run_s or repeats <= 0:
        out = summarize([first_s])
        out["note"] = "single run (first call at this size, after a small-input warm-up)"
        return out
    k = max(1, min(repeats, int(budget_s / max(first_s, 1e-9))))
    return summarize([fn() if self_timed else time_call(fn, device) for _ in range(k)])


def interleaved_runs(fns: Dict[str, Callable[[], Any]], *, device: str = "cpu", rounds: int = 3,
                     warmup: bool = True) -> Dict[str, List[float]]:
    """Time several callables side by side: ``rounds`` round-robin rounds ``A B C A B C ...`` so
    that a change of machine load affects all of them alike. With ``warmup`` every callable is
    first called once untimed (otherwise the caller has warmed them up, e.g. on a small input)."""
    if warmup:
        for f in fns.values():
            f()
    out: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(max(1, rounds)):
        for k, f in fns.items():
            out[k].append(time_call(f, device))
    return out


def setup_torch(threads: Optional[int], seed: int = 0) -> None:
    """Per-child torch settings: thread count, flush denormals (their slow path would distort
    timings of deep stacks), seed."""
    if threads:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# isolated child processes
# --------------------------------------------------------------------------------------------------

_CTX = None
PRELOAD = ["torch", "whiteformer", "benchmarks.common", "benchmarks.attention_scaling", "benchmarks.generation",
           "benchmarks.compressed_attention"]


def _context():
    global _CTX
    if _CTX is None:
        if "forkserver" in mp.get_all_start_methods():
            _CTX = mp.get_context("forkserver")
            _CTX.set_forkserver_preload(PRELOAD)
        else:  # pragma: no cover - Windows / exotic platforms
            _CTX = mp.get_context("spawn")
    return _CTX


def _child_main(conn, fn, args, kwargs) -> None:
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
    finally:
        conn.close()


class ChildFailed(RuntimeError):
    """A child process raised, crashed (e.g. killed by the OOM killer) or timed out."""


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a fresh child process and return its (picklable) result.

    ``fn`` must be a module-level function. Raises :class:`ChildFailed` on an exception in the
    child (message and traceback included), on a crash, or after ``timeout`` seconds (the child
    is killed)."""
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(send, fn, args, kwargs), daemon=True)
    proc.start()
    send.close()
    try:
        if not recv.poll(timeout):
            proc.kill()
            proc.join()
            raise ChildFailed(f"timeout after {timeout:.0f} s")
        try:
            msg = recv.recv()
        except EOFError:
            proc.join()
            raise ChildFailed(f"child process died (exit code {proc.exitcode})") from None
    finally:
        recv.close()
    proc.join()
    if msg[0] == "ok":
        return msg[1]
    raise ChildFailed(f"{msg[1]}\n{msg[2]}")


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------


def _json_default(o: Any):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, torch.dtype):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def default_out_dir(quick: bool) -> Path:
    """benchmarks/results (committed results) or benchmarks/results/quick for --quick runs."""
    return RESULTS_DIR / "quick" if quick else RESULTS_DIR


def write_json(path: Path, obj: Any) -> Path:
    """``obj`` as indented JSON, written whole or not at all (a link at ``path`` is replaced, never
    written through); the results files are replaced by every run."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps(obj, indent=1, default=_json_default) + "\n")


def write_results(out_dir: Path, name: str, quick: bool, result: Any, markdown: str) -> str:
    """A benchmark's ``<name>.json`` (``result``) and ``<name>.md`` (``markdown``) in ``out_dir``,
    ``<name>_quick.*`` for --quick runs; returns that suffix (for the benchmark's other files)."""
    suffix = "_quick" if quick else ""
    write_json(out_dir / f"{name}{suffix}.json", result)
    write_text(out_dir / f"{name}{suffix}.md", markdown)
    return suffix


def fmt_time(s: Optional[float]) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def fmt_bytes(b: Optional[float]) -> str:
    if b is None:
        return "-"
    if b >= GiB:
        return f"{b / GiB:.2f} GiB"
    if b >= MiB:
        return f"{b / MiB:.1f} MiB"
    return f"{b / 1024:.0f} KiB"


def fmt_tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, flush=True)
