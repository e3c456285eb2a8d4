import pytest
import torch


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
