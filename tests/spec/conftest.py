import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """These tiny models are latency-bound: a second intra-op thread only adds waits on a loaded machine."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
