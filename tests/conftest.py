"""Process-wide settings a test may change are put back after it, so a test's numbers do not
depend on which tests ran before it in the same process (an xdist worker runs many modules)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
