import os
import sys
from pathlib import Path

import pytest
import torch

# The Triton kernels' tests (tests/ops/test_triton_*.py) run on CPU through Triton's interpreter, which
# Triton selects when it decorates a kernel: its own library (tl.sum, ...) at `import triton`, so
# the variable must be set before anything (torch.compile included) imports triton. Not on a GPU
# machine, where the kernels are compiled (and the GPU tests cover them).
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """The tests use tiny tensors: intra-op threads only add synchronisation cost (10-40x slower
    on a loaded 2-core machine). Benchmarks, not tests, measure multi-threaded speed."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def fused_kernel_built():
    """Build the fused CPU kernel in this process before a test starts several processes (torchrun):
    on a fresh machine they would otherwise all need the one-time build at the same moment, one
    building and the others waiting on its lock inside collectives (slow on 2 cores). Does nothing
    where kernels are disabled or cannot be built."""
    from whiteformer.ops._kernels.build import fast_path_available

    fast_path_available()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The folder of real data sets some tests read (``mnist/`` in IDX format, ``shakespeare/
    complete_works.txt.xz``): ``$WHITEFORMER_DATA_DIR``, else ``shared/data`` beside the repository
    (where CI puts it). A test whose data set is absent there is skipped, naming the path."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return Path(os.environ.get("WHITEFORMER_DATA_DIR", default))
