import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run many tiny ops; on a shared 2-core machine one thread avoids OpenMP stalls."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
