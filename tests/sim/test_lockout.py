"""An outsider that shares an honest peer's address cannot lock that peer out.

Two nodes on virtual time: ``a`` averages with ``b`` about once a second, ``b`` only answers.
An outsider on a's own host (one NAT, one machine) keeps connections to ``b`` open that never
send a byte. They all count against ``b``'s ``max_handshakes_per_host`` for that host, which
``a``'s dials count against too; what keeps ``a`` in is that a new connection evicts the
host's oldest one that has not proved the swarm key, and that a silent one is cut at the
first-message deadline. The test measures a's rate of committed exchanges for a minute
without the outsider and a minute with it, in the same swarm.
"""

from __future__ import annotations

import dataclasses

import trio
from trio.testing import MockClock

from gossip.config import AveragingConfig, Limits
from gossip.testing.hostile import Outsider
from tests.sim.averaging_swarm import ROUNDS, Peer, constant, open_averaging_swarm

WINDOW = 60.0  # virtual seconds each rate is measured over
SILENT = 1000  # silent connections the outsider opens within the window, at least
FLOOD = 10  # it holds this many at once (more than max_handshakes_per_host) ...
REOPEN = 0.1  # ... and dials each one again this long after b closed it


async def committed_during(peer: Peer, seconds: float) -> int:
    """Exchanges ``peer`` commits in the next ``seconds`` (a window of virtual time)."""
    before = peer.swarm_node.statistics().committed
    await trio.sleep(seconds)
    return peer.swarm_node.statistics().committed - before


async def test_silent_connections_from_an_honest_peers_address_leave_its_exchange_rate(
        autojump_clock: MockClock) -> None:
    limit = Limits().max_handshakes_per_host
    assert FLOOD > limit  # the outsider fills a's places at b
    async with open_averaging_swarm(seed=1, latency=0.005) as swarm:
        # b never starts a round, so every exchange a commits is one a's dial got through.
        b = await swarm.start(constant(64, 2.0), name="b",
                              config=dataclasses.replace(ROUNDS, start="own"))
        a = await swarm.start(constant(64, 1.0), name="a", bootstrap=[b],
                              config=AveragingConfig(interval=1.0, start="own"))
        with trio.fail_after(30):
            await swarm.wait_until(lambda: swarm.sees_ready([a, b], [a, b]))

        quiet = await committed_during(a, WINDOW)
        outsider = Outsider(network=swarm.net.host(a.name))
        async with outsider.open_flood(b.address, FLOOD, first_bytes=b"",
                                       reopen_after=REOPEN) as flood:
            attacked = await committed_during(a, WINDOW)
            silent = flood.opened
        stats = b.swarm_node.roster.statistics()

    print(f"\na's committed exchanges in {WINDOW:g} s: {quiet} alone, {attacked} with "
          f"{silent} silent connections from its address; b evicted "
          f"{stats.connections_evicted}, refused {stats.connections_refused}")
    assert quiet >= 0.8 * WINDOW  # about one a second: the baseline is not itself starved
    assert silent >= SILENT, silent
    assert attacked >= 0.9 * quiet, (attacked, quiet)
    # Every silent connection but the last few made room for a newer one (none lasted the
    # first-message deadline at this rate); none was refused: max_connections is far off.
    assert stats.connections_evicted >= silent - limit
    assert stats.connections_refused == 0
