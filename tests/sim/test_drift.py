"""The drift correction and the swarm's step, on simulated swarms under the autojump clock.

* Eight nodes on label-sorted shards of the digits task (:mod:`tests.sim.digits`: one or two
  classes each) end within a few points of synchronous all-reduce training on the same
  shards, with the default averaging settings: this is what the drift correction is for
  (without it the same swarm ends some forty points lower, bench/efficiency.py).
* On quadratics with known optima (node i pulls towards its own target; the swarm's optimum
  is the targets' mean) the sum of the corrections stays near zero through crashes and
  connection resets that cut exchanges short, and after two nodes leave for good (taking
  their corrections with them) the others fade the bias they left (an adaptive leak,
  gossip.correction.Stray), so the remaining nodes settle on *their* targets' mean.
* Nodes that step at different speeds agree on the step their schedules follow, and no
  node's step ever goes back.
"""

from __future__ import annotations

import itertools
import random
from contextlib import AsyncExitStack

import pytest
import torch
import torch.nn.functional as F
import trio
from trio.testing import MockClock

from gossip.config import AveragingConfig, NodeConfig
from gossip.node import SwarmNode, open_swarm
from gossip.testing.simnet import SimNetwork
from gossip.testing import SimNode, SimSwarm, open_sim_swarm
from tests.sim.digits import BATCH, LR, MOMENTUM, Trainer, accuracy, digits, make_model, shards
from tests.sim.quadratic import Quadratics
from tests.util import SWARM

# --- eight label-sorted nodes against all-reduce -------------------------------------------

NODES = 8
STEPS = 160  # per node: 28 epochs of its shard
STEP_TIME = 0.05  # virtual s
MEAN_GAP = 3.0  # points: the mean node's accuracy below all-reduce's, at most
WORST_GAP = 6.0  # points: the worst node's


def allreduce(seed: int) -> float:
    """One model on the mean loss of a batch from each shard, the trainers' schedule."""
    data = digits()
    model = make_model(seed)
    trainers = [Trainer(model, x, y, steps=STEPS, seed=seed * 100 + i)
                for i, (x, y) in enumerate(shards(data, NODES))]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = LR * (1 - step / STEPS)
        loss = sum(F.cross_entropy(model(t.x[b]), t.y[b]) for t in trainers
                   for b in [t.batch()]) / NODES
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return accuracy(model, data)


@pytest.mark.parametrize("seed", [1, 2])
async def test_eight_label_sorted_nodes_end_near_all_reduce(autojump_clock: MockClock,
                                                            seed: int) -> None:
    data = digits()
    trainers = [Trainer(make_model(seed), x, y, steps=STEPS, seed=seed * 100 + i)
                for i, (x, y) in enumerate(shards(data, NODES))]

    def train(node: SimNode) -> float:
        trainers[node.index].step()
        return 0.0

    config = NodeConfig(averaging=AveragingConfig(start="own"))  # the defaults otherwise
    async with open_sim_swarm(NODES, seed=seed, model=lambda i: trainers[i].model,
                              optimizer=lambda i: trainers[i].optimizer, train=train,
                              step_time=STEP_TIME, config=config) as sim:
        with trio.fail_after(STEPS * STEP_TIME * 10):
            await sim.wait_until(lambda: all(t.done >= STEPS for t in trainers))
        corrected = sum(n.node.statistics().corrected for n in sim.nodes if n.node)
    nodes = [accuracy(t.model, data) for t in trainers]
    reference = allreduce(seed)
    print(f"\nall-reduce {reference:.1f}%, nodes {[round(a, 1) for a in nodes]}, "
          f"{corrected} exchanges swapped corrections")
    assert sum(nodes) / NODES >= reference - MEAN_GAP, (nodes, reference)
    assert min(nodes) >= reference - WORST_GAP, (nodes, reference)
    assert corrected > NODES * STEPS / 2  # the correction was really in use


# --- the sum of the corrections, through crashes, resets and departures -----------------

def corrections(sim) -> list[torch.Tensor]:
    return [n.node.replica.correction_state()["x"] for n in sim.running() if n.node]


def imbalance(sim) -> float:
    """‖Σ c‖ over the running nodes, relative to the sum of their ‖c‖."""
    cs = corrections(sim)
    return float(torch.stack(cs).sum(0).norm() / sum(c.norm() for c in cs))


def offset(sim) -> float:
    """Where the running nodes' center settles, away from the mean of their targets, for what
    their corrections still hold: each node's fixed point has x - t + c = 0 (curvature 1), so
    the center sits at the mean target minus the mean correction, ‖Σ c‖ / N."""
    cs = corrections(sim)
    return float(torch.stack(cs).sum(0).norm()) / len(cs)


async def centered(sim: SimSwarm, models: list[torch.nn.Module], targets: list[torch.Tensor],
                   nodes: range) -> float:
    """How far the nodes' center sits from the mean of their targets, beyond what their
    corrections still hold (``offset``), each averaged over 5 s: a single snapshot of the
    iterates carries the jitter of the steps and exchanges under way."""
    centers, offsets = [], []
    for _ in range(10):
        await sim.run_for(0.5)
        centers.append(torch.stack([models[i].x.detach() for i in nodes]).mean(0))
        offsets.append(offset(sim))
    center = torch.stack(centers).mean(0)
    return float((center - torch.stack(targets).mean(0)).norm()) - sum(offsets) / len(offsets)


async def test_the_corrections_sum_stays_near_zero_and_a_departures_bias_fades(
        autojump_clock: MockClock) -> None:
    swarm = Quadratics(NODES, 16, seed=3)
    models, targets = swarm.models, swarm.targets

    async with open_sim_swarm(NODES, seed=3, model=lambda i: models[i],
                              optimizer=lambda i: swarm.optimizers[i], train=swarm.train,
                              step_time=0.1,
                              config=NodeConfig(averaging=AveragingConfig(
                                  start="own", trust_after=0.0))) as sim:
        spread = sum(float((t - torch.stack(targets).mean(0)).norm()) for t in targets) / NODES
        await sim.run_for(25.0)  # settled: every c near (mean target - own target)
        # Not quite 0: the leak shrinks only the two corrections of each exchange, and trio
        # shuffles the order in which ready tasks run (0.01 to 0.02 from run to run).
        assert imbalance(sim) < 0.04
        # The center is off by what is left of it, and by the iterates' jitter: averaged over
        # 5 s, as below (one snapshot read 0.14 to 0.24 off, in a bound of 0.19 to 0.39).
        assert await centered(sim, models, targets, range(NODES)) < 0.01 * spread

        # Crashes (a restart brings back the checkpoint's correction) and resets that cut
        # exchanges off mid-way, some of them after one side's commit.
        worst = 0.0
        for k in range(20):
            a, b = sim.rng.sample(range(NODES), 2)
            if sim.nodes[a].running and sim.nodes[b].running:
                sim.reset(a, b)
            if k in (3, 10):  # nodes 3 and 2 crash, and come back four seconds later
                sim.crash(k % NODES)
            if k in (7, 14):
                await sim.restart((k - 4) % NODES)
            await sim.run_for(1.0)
            if len(sim.running()) == NODES:  # a crashed node's correction is in its checkpoint
                worst = max(worst, imbalance(sim))
        assert worst < 0.1  # a whole node's correction left out would be about 1/8

        # Two nodes leave for good: their corrections leave with them, a bias the others
        # would otherwise carry (the plain leak took some 45 s to fade it) ...
        cs = corrections(sim)
        assert float(torch.stack(cs[6:]).sum(0).norm() / sum(c.norm() for c in cs)) > 0.15
        for i in (6, 7):
            await sim.stop(i)
        await sim.run_for(5.0)
        # ... and the others fade it as soon as they know (gossip.correction.Stray), so that
        # they settle on the mean of their own targets.
        assert await centered(sim, models, targets[:6], range(6)) < 0.01 * spread
        assert imbalance(sim) < 0.05


# --- the step the swarm schedules by ------------------------------------------------------

async def test_nodes_of_different_speeds_agree_on_a_step_that_never_goes_back(
        autojump_clock: MockClock) -> None:
    # Three nodes take a step every 0.1 s, the fourth three times as fast. Their steps
    # converge on the majority's pace: the fast one holds its step (it pays the debt of its
    # moves down from its next steps) while the others catch up, and no step decreases.
    net = SimNetwork(seed=5, latency=0.005)
    periods = [0.1, 0.1, 0.1, 0.1 / 3]
    history: list[list[int]] = [[] for _ in periods]
    held: list[int] = []  # the fast node's own steps still to take without counting
    async with AsyncExitStack() as stack:
        nodes: list[SwarmNode] = []
        for i in range(len(periods)):
            config = NodeConfig(listen=f"n{i}:7000",
                                bootstrap=[nodes[0].address] if nodes else [],
                                averaging=AveragingConfig(start="own", trust_after=0.0))
            nodes.append(await stack.enter_async_context(open_swarm(
                torch.nn.Linear(4, 2), SWARM, config, network=net.host(f"n{i}"),
                rng=random.Random(i))))

        async def trainer(i: int) -> None:
            while True:
                nodes[i].step()
                history[i].append(nodes[i].global_step)
                if i == 3:
                    held.append(nodes[i].statistics().held)
                await trio.sleep(periods[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(periods)):
                nursery.start_soon(trainer, i)
            await trio.sleep(120.0)
            nursery.cancel_scope.cancel()
            # What a progress line says trains: the own steps, whatever the step does.
            assert [n.statistics().own_steps for n in nodes] == [len(h) for h in history]
    steps = [h[-1] for h in history]
    own = [len(h) for h in history]  # each node's own steps
    print(f"\nown steps {own}, steps scheduled by {steps}")
    for h in history:
        assert all(b >= a for a, b in zip(h, h[1:]))  # never back
    # The three slow nodes agree closely, and the fast one holds its step a few percent
    # above theirs (0-7% over runs: which offers collide varies with trio's scheduling; the
    # most since a node stopped picking its last partner again, which keeps the slow ones on
    # their own pace: 1201-1218 of 1201 own steps in 5 runs, the fast one 1249-1290) ...
    assert max(steps[:3]) - min(steps[:3]) <= 0.01 * max(steps)
    assert max(steps) - min(steps) <= 0.09 * max(steps)
    assert steps[3] < 0.5 * own[3]  # ... on the majority's pace, not the fast node's
    # The fast node's step stands still for stretches while its own steps go on (what froze a
    # node's progress line in the chaos test after its side of a partition had trained
    # faster): its statistics say so, as the daemon's progress line and status do.
    longest = max(len(list(run)) for _, run in itertools.groupby(history[3]))
    assert longest >= 11 and max(held) > 0
