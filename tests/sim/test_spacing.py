"""``averaging.every = "auto"`` in a simulated swarm: on a thin link, each node measures its
step time and its exchanges, spaces its rounds two exchanges apart, and says so in
``statistics().spacing``."""

from __future__ import annotations

import statistics

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip.averaging import Result
from gossip.codec import encoded_nbytes
from gossip.config import LARGE_SPACING, AveragingConfig
from gossip.testing import open_sim_swarm
from tests.util import local

STEP = 0.05  # virtual seconds a training step takes
WIDTH = 128  # a 128 x 128 linear layer: 16,512 parameters, 66,048 bytes a payload in fp32
BANDWIDTH = 20_000.0  # bytes/s each way: an fp32 exchange takes about 3.3 s, 66 steps
PAYLOAD = WIDTH * (WIDTH + 1) * 4


@pytest.mark.parametrize("codec", ["fp32", "int8"])
async def test_auto_spaces_rounds_two_exchanges_apart(autojump_clock: MockClock,
                                                      codec: str) -> None:
    """``codec``: the wide plan's (gossip.plan; int8 is the default): at 132 steps in fp32
    the spacing is wide, where the default sends int8, 3.8 times fewer bytes: 35 steps, still
    wide, so that is what the nodes run at."""
    config = local(averaging=AveragingConfig(every="auto", start="own", trust_after=0.0,
                                             wide_codec=codec))
    async with open_sim_swarm(2, seed=4, model=lambda i: torch.nn.Linear(WIDTH, WIDTH),
                              train=lambda node: 0.0, step_time=STEP, config=config,
                              bandwidth=BANDWIDTH) as sim:
        await sim.wait_ready()
        settled = trio.current_time() + 10.0  # a few exchanges measure the link
        await sim.run_for(60.0)
        stats = {n.name: n.node.statistics() for n in sim.nodes if n.node}
    # The payloads alone, no round trips.
    ideal = 2 * (encoded_nbytes(codec, PAYLOAD // 4) / BANDWIDTH) / STEP
    assert ideal >= LARGE_SPACING  # the wide plan's rounds
    for node in sim.nodes:
        spacing = stats[node.name].spacing
        assert spacing is not None and 0.95 * ideal <= spacing <= 1.15 * ideal, (spacing, ideal)
        # What the node measured itself: the median of its recent committed exchanges, its
        # offers and its answers alike, and the simulator's steady step.
        committed = [e for e in sim.exchanges
                     if e.node is node and e.result is Result.COMMITTED]
        exchange = statistics.median(e.time - e.started for e in committed[-9:])
        assert 0.98 <= spacing / (2 * exchange / STEP) <= 1.02, (spacing, exchange)
        # Its rounds follow the spacing (x U(0.75, 1.25)), where every = 1 would start the
        # next one as soon as the last ended, one exchange (about half the spacing) later.
        own = [e.started for e in committed if e.initiated and e.started > settled]
        # In int8 a round's exchange may start a backoff or two (up to 0.3 s each, when the
        # peer was busy) after the round, a sixth of its 1.8 s: the gaps say nothing there.
        gaps = [(b - a) / (spacing * STEP) for a, b in zip(own, own[1:])]
        assert codec != "fp32" or all(gap >= 0.7 for gap in gaps), gaps
    assert sum(1 for e in sim.exchanges if e.initiated and e.started > settled
               and e.result is Result.COMMITTED) >= 4  # the gaps above are not vacuous


async def test_a_fixed_every_is_the_spacing_and_none_is_none(autojump_clock: MockClock) -> None:
    for every in (7, None):
        config = local(averaging=AveragingConfig(every=every, start="own"))
        async with open_sim_swarm(1, config=config) as sim:
            node = sim.nodes[0].node
            assert node is not None and node.statistics().spacing == every
