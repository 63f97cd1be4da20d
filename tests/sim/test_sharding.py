"""Data shards chosen from the members' announcements (``task.shard = "auto"``), on rosters
over a SimNetwork under MockClock (autojump): each joiner, once joined, takes a shard the
fewest alive members announce (:func:`daemon.sharding.choose_shard`, seeded by its peer id as
the daemon does) and announces it, so joiners arriving over time cover every shard before any
shard gets a second member. "Over time" means after the previous joiner's announcement has
reached the member the next one joins through; joiners arriving together may pick alike.
Only members that proved their identity to the joiner count (:func:`daemon.sharding.announced`):
members invented in one push-pull by a key holder steer nobody.
"""

from __future__ import annotations

import random
from collections import Counter

import trio
from trio.testing import MockClock

from daemon import sharding
from daemon.sharding import choose_shard
from gossip.config import MembershipConfig
from gossip.handshake import PROTOCOL_VERSION
from gossip.identity import Identity
from gossip.tensors import StateSchema, TensorSpec
from gossip.testing.hostile import HostilePeer
from gossip.claims import alive_row, sign_alive
from tests.sim.swarm import SimNode, SimSwarm, open_sim_swarm
from tests.util import SWARM

SHARDS = 4
CONFIG = MembershipConfig()
SCHEMA = StateSchema((TensorSpec("w", (4,), "float32"),))  # a key holder's; no model is swapped


async def join_and_choose(swarm: SimSwarm, node: SimNode, bootstrap: SimNode) -> int:
    """Start ``node``, and once it has joined choose its shard and announce it."""
    await swarm.start(node, [bootstrap.address])
    roster = node.roster
    assert roster is not None
    await roster.wait_joined()
    counted = await sharding.announced(roster)  # as the daemon counts them
    shard = choose_shard(SHARDS, counted, random.Random(str(node.peer)))
    roster.set_meta(shard=shard, shards=SHARDS)
    return shard


def announced(swarm: SimSwarm, chosen: dict[SimNode, int], observers: list[SimNode]) -> bool:
    """Every one of ``observers`` sees every chooser's shard."""
    for observer in observers:
        assert observer.roster is not None
        seen = {m.peer: (m.shard, m.shards) for m in observer.roster.members()}
        if any(seen.get(n.peer) != (s, SHARDS) for n, s in chosen.items() if n is not observer):
            return False
    return True


async def test_joiners_fill_the_least_covered_shards(autojump_clock: MockClock) -> None:
    # The bootstrap node announces no shard (shards 0), so it covers none of the four.
    async with open_sim_swarm(1, latency=0.005) as swarm:
        first = swarm.nodes[0]
        chosen: dict[SimNode, int] = {}
        for wave in (1, 2):
            for _ in range(SHARDS):
                node = swarm.add()
                # Gossip brings the bootstrap node the joiner's shard within a few rounds, or
                # (about 1% of the time, each relay's bounded retransmits all missing it) its
                # next push-pull does.
                with trio.fail_after(CONFIG.push_pull_interval + 5 * CONFIG.probe_interval):
                    chosen[node] = await join_and_choose(swarm, node, first)
                    await swarm.wait_until(lambda: announced(swarm, chosen, [first]))
            # Each wave of joiners covers each shard once more.
            assert sorted(Counter(chosen.values()).values()) == [wave] * SHARDS, chosen
        # Everyone learns every shard: by gossip, or at the latest at a push-pull.
        with trio.fail_after(CONFIG.push_pull_interval + 5 * CONFIG.probe_interval):
            await swarm.wait_until(lambda: announced(swarm, chosen, swarm.running()))
        assert first.roster is not None and first.roster.me.shards == 0


async def test_members_invented_in_gossip_steer_no_joiner(autojump_clock: MockClock) -> None:
    # A key holder announces, in one push-pull with the bootstrap node, seven members that
    # claim shards 0 to 2 at addresses that are not theirs. Counted, they sent both of the
    # next two joiners to shard 3, leaving 1 and 2 without a real node; not counted (a
    # joiner's handshake with each fails), the joiners spread as they do in an honest swarm.
    async with open_sim_swarm(1, latency=0.005) as swarm:
        first = swarm.nodes[0]
        hostile = HostilePeer(SWARM, SCHEMA, network=swarm.net.host("x"))
        # Invented members the key holder signs for itself: it holds their keys.
        claims = [alive_row(sign_alive(hostile.identity, 1, "x:7000", PROTOCOL_VERSION, 0, True))]
        claims += [alive_row(sign_alive(Identity.generate(), 1, f"ghost{i}:7000",
                                        PROTOCOL_VERSION, 0, True, i % 3, SHARDS))
                   for i in range(7)]
        await hostile.push_pull(first.address, claims)
        chosen: dict[SimNode, int] = {}
        for _ in range(2):
            node = swarm.add()
            with trio.fail_after(CONFIG.push_pull_interval + 5 * CONFIG.probe_interval
                                 + CONFIG.push_pull_timeout):
                chosen[node] = await join_and_choose(swarm, node, first)
                await swarm.wait_until(lambda: announced(swarm, chosen, [first]))
        assert len(set(chosen.values())) == 2, chosen  # one each, not both on shard 3
