"""Averaging a model that lives on a GPU (skipped without CUDA).

The replica's flat buffers are page-locked host memory; snapshots copy device to host and
deltas go back host to device at the trainer's step. A CUDA node and a CPU node average to
the same midpoint as two CPU nodes would.
"""

from __future__ import annotations

import pytest
import torch
import trio

import gossip
from gossip.config import NodeConfig
from gossip.plan import plan
from gossip.replica import Replica
from tests.util import SWARM

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The midpoint test also runs with both models on the CPU, so that a CPU machine checks what
# it asserts of the exchange itself.
DEVICES = ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]

# trust_after 0: each node takes the other's state from the first exchange (by default a
# peer alive for less than 10 s is a newcomer whose state moves us by nothing).
CONFIG = gossip.AveragingConfig(every=None, interval=None, download_wait=0.0, trust_after=0.0)


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


@cuda
def test_replica_of_a_cuda_model_uses_pinned_buffers() -> None:
    replica = Replica(mlp(0).cuda())
    flat = replica.buffer()
    assert flat.device.type == "cpu" and flat.is_pinned()
    replica.snapshot(flat)
    replica.queue(torch.ones_like(flat), weight=None, sent_weight=0.0)
    assert replica.apply_pending() == 1
    after = replica.buffer()
    replica.snapshot(after)
    torch.testing.assert_close(after, flat + 1)


@pytest.mark.parametrize("device", DEVICES)
async def test_cuda_and_cpu_nodes_take_the_outer_step_towards_each_other(device: str) -> None:
    """The defaults' first exchange (no progress behind it): each side moves by
    lr x (1 + momentum) x weight of the difference (gossip.outer), whatever its device."""
    factor = CONFIG.outer_lr * (1 + plan(CONFIG, CONFIG.every).momentum) * CONFIG.weight
    gpu, cpu = mlp(1).to(device), mlp(2)
    pairs = [(a.detach().cpu(), b.detach().clone())
             for a, b in zip(gpu.state_dict().values(), cpu.state_dict().values())
             if a.is_floating_point()]
    expected = [(a + factor * (b - a), b + factor * (a - b)) for a, b in pairs]
    async with gossip.open_swarm(gpu, SWARM, NodeConfig(averaging=CONFIG)) as a:
        own = gossip.AveragingConfig(every=None, interval=None, start="own", trust_after=0.0)
        async with gossip.open_swarm(cpu, SWARM, NodeConfig(bootstrap=(a.address,),
                                                            averaging=own)) as b:
            while not b.roster.alive(ready=True):
                await b.roster.wait_changed()
            with trio.fail_after(30):
                assert await b.average_now() is gossip.Result.COMMITTED
            assert a.step() == 1 and b.step() == 1
    got_gpu = [t.cpu() for t in gpu.state_dict().values() if t.is_floating_point()]
    got_cpu = [t for t in cpu.state_dict().values() if t.is_floating_point()]
    for (e_gpu, e_cpu), g, c in zip(expected, got_gpu, got_cpu):
        torch.testing.assert_close(g, e_gpu)
        torch.testing.assert_close(c, e_cpu)


@cuda
def test_averager_trains_a_cuda_model() -> None:
    model = mlp(3).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 16, device="cuda"), torch.randint(0, 4, (64,), device="cuda")
    with gossip.Averager(model, SWARM, NodeConfig(averaging=CONFIG)) as avg:
        for _ in range(5):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            with avg.lock:
                opt.step()
            avg.step(samples=64)
        assert avg.global_step == 5
        assert avg.statistics().samples == 320
