"""A swarm-key holder's forged departures (issue 48, B1), against averaging swarms in virtual
time.

The attack as measured on real daemons: a key holder sends A ``Left(B, 2^53 - 1)`` and B
``Left(A, 2^53 - 1)``, and neither can refute a claim at that incarnation, so the pair never
averages again; one datagram per (node, member) pair partitions a whole swarm. A key holder
cannot sign as B (gossip.claims), so its best forgery carries its own key's proof. Here it
sends exactly that, one datagram per pair, to a swarm of 8 and then across a restart, and
every member must stay ALIVE in every table while exchanges go on committing.
"""

from __future__ import annotations

import dataclasses

import torch
import trio
from trio.testing import MockClock

from gossip.averaging import Result
from gossip.member import State
from gossip.testing.hostile import HostilePeer
from tests.sim.averaging_swarm import (ROUNDS, AveragingSwarm, Peer, constant,
                                      open_averaging_swarm, start_all)
from tests.util import SWARM

N = 8
OWN = dataclasses.replace(ROUNDS, start="own")  # a restarted node keeps its own model


async def forge_departures(swarm: AveragingSwarm, targets: list[Peer],
                           members: list[Peer]) -> None:
    """One forged datagram to each target about each other member: ``Left(member, 2^53 - 1)``."""
    host = swarm.net.host("attacker")
    hostile = HostilePeer(SWARM, constant(4, 0.0), network=host)
    endpoint = await host.open_datagram("attacker:0")
    try:
        for target in targets:
            for member in members:
                if member is not target:
                    forged = hostile.forged_left(member.identity.peer_id)
                    await endpoint.send(hostile.datagram((forged,)), target.address)
    finally:
        await endpoint.aclose()


def refused(peer: Peer) -> int:
    return peer.swarm_node.roster.statistics().claims_refused


def everyone_alive(peers: list[Peer]) -> bool:
    """Every peer holds every other ALIVE, and nobody LEFT."""
    for peer in peers:
        seen = {m.peer: m.state for m in peer.swarm_node.roster.members()}
        if any(seen.get(p.identity.peer_id) != State.ALIVE for p in peers if p is not peer):
            return False
    return True


async def watch(swarm: AveragingSwarm, peers: list[Peer], seconds: float) -> set[str]:
    """Run rounds for ``seconds`` of virtual time (the audit watched for 33 s), checking every
    table after each; the peers that committed an exchange meanwhile."""
    before = {p.name: p.swarm_node.statistics().committed for p in peers}
    end, results = trio.current_time() + seconds, []
    while trio.current_time() < end:
        with trio.fail_after(60):
            results += await swarm.round()
        assert everyone_alive(peers)
    assert results.count(Result.COMMITTED) >= len(results) // 4
    return {p.name for p in peers if p.swarm_node.statistics().committed > before[p.name]}


async def test_forged_departures_of_every_pair_change_no_table(autojump_clock: MockClock) -> None:
    async with open_averaging_swarm(seed=3) as swarm:
        with trio.fail_after(30):
            peers = await start_all(swarm, [constant(4, float(i)) for i in range(N)])
        await forge_departures(swarm, peers, peers)
        committed = await watch(swarm, peers, 40.0)
        assert all(refused(p) == N - 1 for p in peers)  # each forgery arrived, and was refused
        assert committed == {p.name for p in peers}  # every node went on averaging
        values = torch.stack([p.model.w.detach() for p in peers])
        assert float(values.std()) < 0.5  # mixed across the swarm (it began at 2.45)


async def test_forged_departures_do_not_stick_across_a_restart(autojump_clock: MockClock) -> None:
    # One node restarts with the same identity (incarnation back at 0) after the forgeries,
    # and again after a genuine departure: it takes its place back both times.
    async with open_averaging_swarm(seed=4) as swarm:
        with trio.fail_after(30):
            peers = await start_all(swarm, [constant(4, float(i)) for i in range(4)])
        victim = peers[-1]
        await forge_departures(swarm, peers, peers)
        for how in ("crash", "leave"):
            if how == "crash":
                swarm.crash(victim)
            else:
                await victim.swarm_node.roster.leave()
                swarm.net.crash(victim.name)
            with trio.fail_after(120):
                await swarm.wait_until(lambda: victim.node is None and all(
                    p.swarm_node.roster.get(victim.identity.peer_id) is None
                    or p.swarm_node.roster.get(victim.identity.peer_id).state != State.ALIVE
                    for p in peers[:-1]))
            await swarm.restart(victim, bootstrap=peers[:1], config=OWN)
            await forge_departures(swarm, peers[:-1], [victim])
            with trio.fail_after(120):
                await swarm.wait_until(lambda: swarm.sees_ready(peers, peers))
            assert everyone_alive(peers)
