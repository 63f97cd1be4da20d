"""A key holder cannot take the swarm's step by being always free (issue A1, virtual time).

The attack, as an independent client mounted it on real daemons: a member announces step
2^53 − 1, starts no rounds of its own and takes every offer at once. The honest nodes are often
busy with each other's exchanges, the liar never is, so it committed far more than its share of
their rounds; while the step's estimate was the median of the last 32 *rounds*, it held most of
them and moved every node's step to 2^53 − 1 (steps never go back, so for good). The estimate
now counts each host once (:class:`gossip.standing.PeerSteps`): one liar among five hosts is
outvoted however often it commits.

Here four honest nodes step every 0.1 s on links slow enough that an exchange takes most of a
step, and a fifth node, the liar, holds a step of 2^53 − 1 from the start, never trains and
never starts a round. Measured on the code before the fix: every honest node's step was past
5.6 x 10^15 after 20 s (200 steps of its own); after it, every honest node's step is its own
200, though the liar took part in 110 committed exchanges.
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import torch
import trio
from trio.testing import MockClock

from gossip.config import AveragingConfig, NodeConfig
from gossip.messages import MAX_COUNT
from gossip.node import SwarmNode, open_swarm
from gossip.replica import Counters
from gossip.simnet import SimNetwork
from tests.util import SWARM

HONEST = 4
PERIOD = 0.1  # s per honest step
SECONDS = 20.0


async def test_one_host_that_is_always_free_cannot_take_the_step(
        autojump_clock: MockClock) -> None:
    # 64 x 64 float32 weights, 16 kB a payload: at 400 kB/s an exchange takes about 0.08 s.
    net = SimNetwork(seed=7, latency=0.005, bandwidth=400_000)
    own = [0] * HONEST
    async with AsyncExitStack() as stack:
        nodes: list[SwarmNode] = []
        for i in range(HONEST + 1):
            liar = i == HONEST
            averaging = (AveragingConfig(start="own", trust_after=0.0, every=None, interval=None)
                         if liar else AveragingConfig(start="own", trust_after=0.0))
            config = NodeConfig(listen=f"n{i}:7000",
                                bootstrap=[nodes[0].address] if nodes else [],
                                averaging=averaging)
            nodes.append(await stack.enter_async_context(open_swarm(
                torch.nn.Linear(64, 64), SWARM, config, network=net.host(f"n{i}"),
                rng=random.Random(i),
                counters=Counters(MAX_COUNT, 0, 1.0) if liar else None)))

        async def trainer(i: int) -> None:
            while True:
                nodes[i].step()
                own[i] += 1
                await trio.sleep(PERIOD)

        async with trio.open_nursery() as nursery:
            for i in range(HONEST):
                nursery.start_soon(trainer, i)
            await trio.sleep(SECONDS)
            steps = [nodes[i].global_step for i in range(HONEST)]
            taken = nodes[HONEST].statistics().committed
            nursery.cancel_scope.cancel()
    print(f"\nown steps {own}, steps {steps}, exchanges the liar took part in {taken}")
    assert taken > 0  # it was in the swarm's rounds
    for mine, step in zip(own, steps):
        assert step <= 1.1 * mine + 10, (own, steps)
