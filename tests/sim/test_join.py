"""A late joiner that downloads takes no node's held-out accuracy down (virtual time).

The demo's case, measured: two nodes train the daemon's digits task (SGD, lr 0.05, momentum
0.9) on two label-sorted thirds of the data and agree on a model that knows their classes
(67% of the test set); a third node joins late, downloads that model and trains on the last
third, classes neither has seen. Before deltas were spread over the steps between exchanges,
every such join dipped: an exchange moved a node half-way to the joiner at once, the node's
own loss jumped, and its momentum carried its steps on long after that loss was repaired,
down to 40-50% held-out accuracy, 20 points under where it stood before the join
(gossip.replica, "Deltas over several steps"). Now each node's held-out accuracy, read every
10 steps, stays within 2 points of its level just before the join, at 10, 25 and 60 local
steps per exchange, and the swarm still learns the joiner's classes.

The two nodes start from one model trained on their data (as if they had trained together for
long), so that "where it stood before the join" is a level, not a moving target.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import trio
from trio.testing import MockClock

from daemon.task import Shard
from daemon.tasks.digits import load, shard_indices
from gossip.config import AveragingConfig, NodeConfig
from gossip.plan import plan
from gossip.testing import SimNode, open_sim_swarm

pytestmark = pytest.mark.slow

LR, MOMENTUM, BATCH = 0.05, 0.9, 32  # the digits task's defaults
PRETRAIN = 1500  # steps of the two nodes' common model, trained on their data
BEFORE = 800  # steps each trains in the swarm before the join (8 virtual s: the joiner
# comes later than half of trust_after after the two started, so it is not one of them)
AFTER = 2000  # steps after the join that are watched
EVERY = 10  # steps between evaluations
STEP_TIME = 0.01  # virtual s a step takes: the links are 1 ms, so rounds come on time
POINTS = 2.0  # the most a node's held-out accuracy may fall below its level before the join
LEARNED = 10.0  # points the swarm must gain by the end: it took in the joiner's classes


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


class Node:
    """One node's model, optimizer, label-sorted shard and held-out accuracy record."""

    def __init__(self, index: int, data: tuple[torch.Tensor, ...], seed: int) -> None:
        x, y, self.x_test, self.y_test = data
        mine = torch.from_numpy(shard_indices(y.numpy(), Shard(index, 3)))
        self.x, self.y = x[mine], y[mine]
        self.model = make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.generator = torch.Generator().manual_seed(seed * 10 + index)
        self.steps = 0
        self.record: list[tuple[float, float]] = []  # (virtual time, held-out accuracy %)

    def step(self) -> None:
        batch = torch.randint(len(self.y), (BATCH,), generator=self.generator)
        loss = F.cross_entropy(self.model(self.x[batch]), self.y[batch])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        if self.steps % EVERY == 0:
            self.record.append((trio.current_time(), self.accuracy()))

    @torch.no_grad()
    def accuracy(self) -> float:
        predicted = self.model(self.x_test).argmax(1)
        return 100.0 * (predicted == self.y_test).float().mean().item()


def common_start(nodes: list[Node], seed: int) -> None:
    """Train one model on the two first nodes' data and give it to all three."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = torch.cat([nodes[0].x, nodes[1].x]), torch.cat([nodes[0].y, nodes[1].y])
    generator = torch.Generator().manual_seed(seed)
    for _ in range(PRETRAIN):
        batch = torch.randint(len(y), (BATCH,), generator=generator)
        loss = F.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for node in nodes:
        node.model.load_state_dict(model.state_dict())


# 8: rounds every 16 steps, the close plan; 25 and 60: the wide plan (gossip.plan).
@pytest.mark.parametrize("spacing", [8, 25, 60])
async def test_a_late_joiner_takes_no_nodes_accuracy_down(autojump_clock: MockClock,
                                                          spacing: int) -> None:
    """``spacing``: local steps per round at each node. A node starts a round every
    ``averaging.every`` steps and also answers its peers', so ``every`` is twice that."""
    data = tuple(torch.from_numpy(a) for a in load())
    seed = spacing
    nodes = [Node(i, data, seed) for i in range(3)]
    common_start(nodes, seed)
    config = NodeConfig(averaging=AveragingConfig(start="own", every=2 * spacing))

    def train(sim_node: SimNode) -> float:
        nodes[sim_node.index].step()
        return 0.0

    async with open_sim_swarm(3, seed=seed, model=lambda i: nodes[i].model,
                              optimizer=lambda i: nodes[i].optimizer, train=train,
                              step_time=STEP_TIME, config=config, late=[2]) as sim:
        with trio.fail_after(100 * BEFORE * STEP_TIME):
            await sim.wait_until(lambda: all(n.steps >= BEFORE for n in nodes[:2]))
        joined = trio.current_time()
        await sim.join(2)
        with trio.fail_after(100 * AFTER * STEP_TIME):
            await sim.wait_until(lambda: all(n.steps >= BEFORE + AFTER for n in nodes[:2]))
            await sim.wait_until(lambda: nodes[2].steps >= AFTER // 2)
        rounds = [n.node.statistics().committed for n in sim.nodes[:2] if n.node]
        downloaded = sim.nodes[2].node is not None and sim.nodes[2].node.downloaded is not None
    assert downloaded
    # The spacing asked for is the one the nodes ran at: each round of a node makes the plan's
    # exchanges (gossip.plan: from LARGE_SPACING on, with up to ROUND_PEERS others: one before
    # the join, two after it), and the node answers as many.
    after = min(plan(config.averaging, 2 * spacing).peers, 2)
    expected = (BEFORE + after * AFTER) / spacing
    assert all(0.7 <= expected / r <= 1.4 for r in rounds), (rounds, expected)
    for node in nodes[:2]:
        before = [a for t, a in node.record if t <= joined][-5:]
        after = [a for t, a in node.record if t > joined]
        level = sum(before) / len(before)
        assert min(after) >= level - POINTS, (
            f"{spacing} steps per exchange: held-out accuracy {level:.1f}% before the join fell to "
            f"{min(after):.1f}% after it")
        assert sum(after[-10:]) / 10 >= level + LEARNED, (
            f"{spacing} steps per exchange: the swarm did not take in the joiner's classes "
            f"({level:.1f}% before, {sum(after[-10:]) / 10:.1f}% at the end)")


async def test_late_nodes_wait_for_join_and_download(autojump_clock: MockClock) -> None:
    with pytest.raises(ValueError, match="late must name nodes 1..2"):
        async with open_sim_swarm(3, late=[0]):
            pass
    async with open_sim_swarm(3, late=[2]) as sim:
        assert not sim.nodes[2].running and sim.nodes[2].node is None
        with pytest.raises(ValueError, match="cannot join n1: it is running"):
            await sim.join(1)
        await sim.wait_ready([0, 1])
        await sim.join(2)
        with trio.fail_after(30):
            await sim.wait_ready()
        joined = sim.nodes[2].node
        assert joined is not None and joined.downloaded is not None  # not its own model
        with pytest.raises(ValueError, match="cannot join n2"):
            await sim.join(2)
