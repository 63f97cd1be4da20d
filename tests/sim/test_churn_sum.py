"""The drift corrections' swarm-wide sum through a join, a crash and a departure (virtual time).

Gradient tracking keeps ``Σ c = 0`` over the members: only then is every node's corrected
gradient the swarm's (gossip.correction). A joiner brings ``c = 0`` and swaps no estimates as a
newcomer, so a join keeps the sum; a node that crashes or leaves takes its ``c`` with it and
leaves the others summing to ``−c``, which the leak fades, faster for a few exchanges once the
others see it dead or left (gossip.correction.Stray). Four nodes on label-skewed data (so that
the corrections are large) exchange every 10 steps with the defaults (outer step on); the sum's
size relative to the corrections' (``‖Σ c‖ / Σ ‖c‖``) is read after each event.

Measured in 10 runs: 0.005 to 0.05 before and after the join; 0.23 to 0.44 at a crash, and
0.01 to 0.02 five seconds after the others knew of it; 0.06 to 0.16 three seconds after a
departure, which is faded on an estimate of its share (1/N, here 1/3) smaller than the share
the departed node held (0.41 to 0.48). Before the two sides of an exchange moved their
corrections by one fraction (the smaller of their ``Commit``'s), the sum read up to 0.2 before
any event; and with the plain leak alone a crash's share was still 0.2 to 0.4 some 300 steps
after the crash.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gossip.config import AveragingConfig, NodeConfig
from gossip.member import State
from gossip.testing import SimNode, SimSwarm, open_sim_swarm

N = 5  # four at the start, one late joiner
STEP_TIME = 0.01
SETTLE = 3.0  # virtual s after an event: 300 steps, about 30 rounds of each node's own
# ‖Σ c‖ / Σ ‖c‖ with no departure behind it is not 0: the leak shrinks only the two
# corrections of each exchange, and an exchange only one side applied (a lost Commit) moves one.
# The bounds sit above the readings (in the docstring), well below a departed correction's share.
NEAR_ZERO = 0.1
NEAR_ZERO_FEW = 0.25  # with three nodes left, and a departure faded on a share of 1/3
SETTLE_CRASH = 5.0  # after the others know of the crash: the first few exchanges fade it


def relative_sum(sim: SimSwarm) -> float:
    cs = [n.node.replica.correction_state() for n in sim.running()]
    flat = [torch.cat([c[k].flatten() for k in sorted(c)]) for c in cs]
    total = torch.stack(flat).sum(0)
    return float(total.norm()) / max(sum(float(f.norm()) for f in flat), 1e-12)


def share(sim: SimSwarm, node: SimNode) -> float:
    """``node``'s correction's size relative to all the running nodes' together."""
    sizes = {n: sum(float(c.norm() ** 2) for c in n.node.replica.correction_state().values())
             ** 0.5 for n in sim.running()}
    return sizes[node] / max(sum(sizes.values()), 1e-12)


@pytest.mark.slow
async def test_the_sum_of_corrections_stays_near_zero_through_a_join_a_crash_and_a_departure(
        autojump_clock) -> None:
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3) for _ in range(N)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    generator = torch.Generator().manual_seed(1)
    centres = torch.randn(3, 4, generator=generator) * 2

    def train(node: SimNode) -> float:
        label = node.index % 3  # skewed: each node sees one class
        x = centres[label] + torch.randn(8, 4, generator=generator)
        optimizer = optimizers[node.index]
        optimizer.zero_grad()
        loss = F.cross_entropy(node.model(x), torch.full((8,), label))
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    config = dataclasses.replace(NodeConfig.local(), averaging=AveragingConfig(
        every=10, interval=None, start="own", trust_after=1.0))
    async with open_sim_swarm(N, seed=2, model=lambda i: models[i],
                              optimizer=lambda i: optimizers[i], train=train,
                              step_time=STEP_TIME, config=config, late=[N - 1]) as sim:
        await sim.run_for(6.0)
        assert min(sum(float(c.norm()) for c in n.node.replica.correction_state().values())
                   for n in sim.running()) > 0  # the corrections are not trivially zero
        before = relative_sum(sim)
        assert before < NEAR_ZERO

        await sim.join(N - 1)  # a join: the sum is kept
        await sim.run_for(SETTLE)
        after_join = relative_sum(sim)

        crashing = share(sim, sim.nodes[1])
        sim.crash(1)  # a crash: its correction is gone
        at_crash = relative_sum(sim)
        # The others learn of it once its suspicion times out (SWIM: several seconds).
        await sim.wait_until(lambda: all(sim.view(n).get(sim.nodes[1]) == State.DEAD
                                         for n in sim.running()))
        await sim.run_for(SETTLE_CRASH)
        after_crash = relative_sum(sim)

        leaving = share(sim, sim.nodes[2])
        await sim.stop(2)  # a departure: announced, so known at once
        at_departure = relative_sum(sim)
        await sim.run_for(SETTLE)
        after_departure = relative_sum(sim)

    # Each event took a correction of about a node's share of the size with it: without the
    # fade, what it left would read about share / (1 − share) (0.3 to 0.8 here).
    assert crashing > 0.1 and leaving > 0.1, (crashing, leaving)
    assert after_join < NEAR_ZERO, after_join
    assert after_crash < NEAR_ZERO, (at_crash, after_crash)
    assert after_departure < NEAR_ZERO_FEW, (at_departure, after_departure)
    print(f"sum/size: before {before:.3f}, after the join {after_join:.3f}, at the crash "
          f"{at_crash:.3f} (it held {crashing:.3f} of the size), after {after_crash:.3f}, at the "
          f"departure {at_departure:.3f} (it held {leaving:.3f}), "
          f"after {after_departure:.3f}")
