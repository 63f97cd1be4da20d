"""A round of several exchanges in a simulated swarm (gossip.rounds, gossip.plan): the round
makes its exchanges with as many different peers, and with the outer step once a round only
the round's first commit takes it, where at each exchange every commit does."""

from __future__ import annotations

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip.averaging import Result
from gossip.config import AveragingConfig
from gossip.testing import open_sim_swarm
from tests.util import local


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("cadence", ["round", "exchange"])
async def test_a_round_of_three_exchanges_and_where_the_outer_step_is_taken(
        autojump_clock: MockClock, cadence: str) -> None:
    config = local(averaging=AveragingConfig(every=None, interval=None, start="own",
                                             trust_after=0.0, peers=3, outer_cadence=cadence))
    models = [torch.nn.Linear(4, 4) for _ in range(5)]
    async with open_sim_swarm(5, seed=3, model=lambda i: models[i], config=config) as sim:
        await sim.wait_ready()
        first = sim.nodes[0].node
        assert first is not None
        with trio.fail_after(60):
            assert await first.average_now() is Result.COMMITTED
        ours = [e for e in sim.exchanges if e.node is sim.nodes[0] and e.initiated]
        assert [e.result for e in ours] == [Result.COMMITTED] * 3
        assert len({e.peer for e in ours}) == 3  # one exchange with each of three peers
        answered = {e.node for e in sim.exchanges if not e.initiated}
        assert answered == {e.peer for e in ours}
        outer = first.replica.outer
        assert outer is not None and outer.anchored
        # The deltas are added as each exchange ends (no trainer): the node sits where its
        # last commit put it. At each exchange that is the anchor; once a round the anchor
        # is where the first commit put it, and the next two moved on from there plainly.
        n = first.replica.schema.numel
        off = flat(models[0]) - first.replica.outer_state()["anchor"][:n]
        if cadence == "exchange":
            assert float(off.norm()) < 1e-5
            assert all(n.node.replica.outer.anchored for n in answered)
        else:
            assert float(off.norm()) > 1e-3
            # Nodes that only answered take no outer step: theirs comes in their own rounds.
            assert not any(n.node.replica.outer.anchored for n in answered)


async def test_honest_peers_of_rounds_of_three_stay_within_each_others_budgets(
        autojump_clock: MockClock) -> None:
    """A host's budget of members' offers grows with the exchanges the responder's own rounds
    make: where every node makes three a round, an honest peer offers three times as often
    as at one, and is not answered busy for it."""
    # trust_after > 0: with 0 every key holder is trusted at once and there is no budget.
    config = local(averaging=AveragingConfig(every=None, interval=None, start="own",
                                             trust_after=1.0, peers=3))
    async with open_sim_swarm(4, seed=5, model=lambda i: torch.nn.Linear(4, 4),
                              config=config) as sim:
        await sim.wait_ready()
        await sim.run_for(2.0)  # virtual: past trust_after, every peer stands with the others
        with trio.fail_after(600):
            for _ in range(30):  # rounds in turn: each node's three offers a round
                for node in sim.nodes:
                    assert node.node is not None
                    await node.node.average_now()
        stats = [n.node.statistics() for n in sim.nodes if n.node is not None]
    assert sum(s.committed for s in stats) >= 2 * 30 * 4 * 3 * 0.9
    assert sum(s.members_limited for s in stats) == 0


@pytest.mark.parametrize("every, held", [(1, False), (40, True)])
async def test_a_plan_that_exchanges_no_estimates_holds_the_correction(
        autojump_clock: MockClock, every: int, held: bool) -> None:
    """From the start (a restarted node's checkpoint may bring a correction) and after each
    round's plan: at wide spacing nothing updates the correction, so no step adds it."""
    config = local(averaging=AveragingConfig(every=every, interval=None, start="own",
                                             trust_after=0.0))
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    async with open_sim_swarm(2, seed=2, model=lambda i: models[i],
                              optimizer=lambda i: optimizers[i], config=config) as sim:
        await sim.wait_ready()
        nodes = [n.node for n in sim.nodes if n.node is not None]
        for node in nodes:
            correction = node.replica.correction
            assert correction is not None and correction.hold is held
        with trio.fail_after(60):
            await nodes[0].average_now()
        for node in nodes:
            correction = node.replica.correction
            assert correction is not None and correction.hold is held
            assert correction.strength() == (0.0 if held else 1.0)
