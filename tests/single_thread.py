"""A module fixture that runs a test module on one torch thread (test helper).

The models here are tiny: a second thread buys nothing, and on a busy 2-core
machine OpenMP's barriers wait for a descheduled thread, which made eager
steps 10x slower. Import `one_thread` into a test module to use it.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
