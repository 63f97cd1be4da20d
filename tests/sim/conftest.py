"""Fixtures shared by the simulated-swarm tests."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The models in simulated swarms are tiny and gain nothing from intra-op threads, and on
    a busy machine their spin waits cost far more than the work (a 160 kB copy: 1-5 ms
    instead of 12 us)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
